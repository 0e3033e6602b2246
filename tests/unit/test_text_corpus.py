"""The calibration / held-out split of Python's own documentation text, the
perplexity windows and the greedy-agreement count of ``prefixserve eval``."""

from __future__ import annotations

import pytest

from cluster.bench.evaluate import agreement
from cluster.shared.text_corpus import calibration_text, held_out_text, token_windows


def test_held_out_text_is_never_calibration_text():
    held, calib = held_out_text(), calibration_text()
    assert len(held) > 20_000 and len(calib) > 5 * len(held)
    held_topics, calib_topics = set(held.split("\n\n")), set(calib.split("\n\n"))
    shared = {t for t in held_topics & calib_topics if len(t) > 200}
    assert not shared  # no paragraph of substance in both parts
    assert held == held_out_text()  # deterministic


def test_token_windows_cover_at_most_max_tokens_without_overlap():
    ids = list(range(1000))
    windows = token_windows(ids, 300, 700)
    assert [len(w) for w in windows] == [300, 300, 100]
    assert sum(windows, []) == ids[:700]
    assert token_windows(list(range(601)), 300, 10_000)[-1] == list(range(300, 600))
    assert all(len(w) >= 2 for w in token_windows(list(range(601)), 300, 10_000))  # a 1-token tail is dropped
    with pytest.raises(ValueError, match="at least 2"):
        token_windows(ids, 1, 10)


def test_agreement_counts_tokens_before_the_first_divergence():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    ours = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]
    result = agreement(ours, ref)
    assert result["per_prompt"] == [4, 2, 0]
    assert result["min"] == 0 and result["full_agreement"] == "1/3" and result["mean_tokens_to_divergence"] == 2.0
