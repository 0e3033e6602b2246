"""bench serve's continued-turn hit rate: cached / prompt tokens over the turns after each conversation's first
(issue 52: the cached share of continued turns shows in a multi-turn run)."""

from __future__ import annotations

from cluster.bench.metrics import RequestRecord, format_summary, summarize


def _turn(conversation: int, turn: int, prompt: int, cached: int, error: str = "") -> RequestRecord:
    return RequestRecord(conversation, turn, prompt, 4, ttft=0.1, latency=0.2, prompt_tokens=prompt,
                         completion_tokens=4, cached_prompt_tokens=cached, error=error)


def test_continued_turns_have_their_own_hit_rate():
    records = [_turn(0, 0, 40, 0), _turn(0, 1, 60, 48), _turn(0, 2, 80, 64), _turn(1, 0, 40, 16),
               _turn(1, 1, 60, 0), _turn(1, 2, 0, 0, error="UNAVAILABLE")]
    s = summarize(records, duration=1.0)
    assert s["continued_turns"] == 3
    assert s["continued_turn_hit_rate"] == round((48 + 64 + 0) / (60 + 80 + 60), 4)  # first turns left out
    assert s["prefix_hit_rate"] == round(128 / 280, 4)
    assert any("Continued-turn hit rate (3 turns):" in line and "56.0%" in line for line in format_summary("t", s))


def test_single_turn_runs_show_no_continued_turns():
    s = summarize([_turn(0, 0, 40, 16), _turn(1, 0, 40, 16)], duration=1.0)
    assert "continued_turn_hit_rate" not in s
    assert not any("Continued-turn" in line for line in format_summary("t", s))
