"""English text shipped with Python itself (``pydoc_data.topics``: the help
texts of the language reference), for calibrating quantization and measuring
perplexity without a download.

The topics, sorted by name, are split once: every fifth is held out for
evaluation, the rest is calibration text, so no quantizer is ever calibrated
on the text it is judged on.
"""

from __future__ import annotations

HELD_OUT_EVERY = 5


def _topics() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[name].strip() for name in sorted(topics)]


def calibration_text() -> str:
    """The calibration part (four topics in five)."""
    return "\n\n".join(t for i, t in enumerate(_topics()) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1)


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
