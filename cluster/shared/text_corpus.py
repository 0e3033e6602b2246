"""English text shipped with Python itself (``pydoc_data.topics``: the help
texts of the language reference), for calibrating quantization and measuring
perplexity without a download.

The topics, sorted by name, are split once: every fifth is held out for
evaluation, the rest is calibration text, so no quantizer is ever calibrated
on the text it is judged on. Some topics repeat paragraphs of others: a
paragraph of the held-out part is dropped from the calibration part.
"""

from __future__ import annotations

HELD_OUT_EVERY = 5


def _topics() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[name].strip() for name in sorted(topics)]


def calibration_text() -> str:
    """The calibration part (four topics in five, without the held-out part's paragraphs)."""
    held = set(held_out_text().split("\n\n"))
    kept = "\n\n".join(t for i, t in enumerate(_topics()) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1)
    return "\n\n".join(p for p in kept.split("\n\n") if p not in held)


def held_out_text() -> str:
    """The evaluation part (every fifth topic), never used for calibration."""
    return "\n\n".join(t for i, t in enumerate(_topics()) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1)


def token_windows(token_ids: list[int], window: int, max_tokens: int) -> list[list[int]]:
    """Consecutive, non-overlapping windows of ``window`` tokens, at most ``max_tokens`` in all
    (a shorter last window is kept when it has at least two tokens)."""
    if window < 2 or max_tokens < 2:
        raise ValueError(f"window and max_tokens must be at least 2, got {window} and {max_tokens}")
    ids = token_ids[:max_tokens]
    return [ids[i : i + window] for i in range(0, len(ids), window) if len(ids[i : i + window]) >= 2]
