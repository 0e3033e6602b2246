"""Phi-3's ``longrope`` RoPE scaling (``rope_type: longrope``, legacy ``su``), read from a config.

Two sets of per-frequency divisors: ``short_factor`` for sequences of at most
``original_max_position_embeddings`` tokens, ``long_factor`` beyond, and cos/sin
multiplied by ``attention_factor`` in both. transformers picks the set per
forward from that forward's length, and its Phi-3 ``generate`` drops the KV cache
when a sequence first grows past ``original_max_position_embeddings`` and
recomputes the whole sequence with the long factors. So at every step a
sequence is computed entirely with one set, chosen by its current length
(``Sequence.rope_long``); the engine recomputes a sequence whose KV was
computed short when it crosses (``step_update.py``), and the rotary table holds
both sets (``RotaryEmbedding``, long rows after the short ones).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class LongRopeScaling:
    """Phi-3 LongRoPE: per-frequency divisors for short and long sequences."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float


def parse_longrope(params: Mapping[str, Any], config: Mapping[str, Any], head_dim: int) -> LongRopeScaling:
    """transformers' reading: a top-level ``original_max_position_embeddings``
    (Phi-3 keeps it there) wins over the rope parameters' one; without
    ``attention_factor`` it is ``sqrt(1 + ln(factor) / ln(original))`` where
    ``factor`` defaults to ``max_position_embeddings / original`` (1 when <= 1).

    Raises:
        ValueError: A factor list missing or of the wrong length.
    """
    original = config.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
    if original is None:
        original = config.get("max_position_embeddings", 2048)
    original = int(original)
    factors = {}
    for key in ("short_factor", "long_factor"):
        values = params.get(key)
        if not isinstance(values, (list, tuple)) or len(values) != head_dim // 2:
            raise ValueError(f"longrope rope scaling needs {key!r}: a list of head_dim / 2 = {head_dim // 2} numbers")
        factors[key] = tuple(float(v) for v in values)
    factor = params.get("factor")
    if factor is None:
        factor = int(config.get("max_position_embeddings", 2048)) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return LongRopeScaling(original_max_position_embeddings=original, attention_factor=float(attention_factor),
                           **factors)
