"""``int4``'s grids (``workers/model/quant/methods.py``): Q4_1's float min for
groups of 32, GPTQ's integer zero point (rounded to nearest) for 64 and 128."""

from __future__ import annotations

import numpy as np
import pytest

from workers.model.quant import gptq
from workers.model.quant.methods import DEFAULT_INT4_GROUP, quantize_int4


def _weights(n: int = 24, k: int = 320, seed: int = 0) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    w[:, ::7] = 0.0  # exact zeros, as pruned or tiny weights are
    return w


def test_the_default_group_is_32_on_q4_1s_grid():
    assert DEFAULT_INT4_GROUP == 32
    w = _weights()
    d = quantize_int4(w, 32)
    assert d.format == "int4-g32" and d.q.max() <= 15
    groups = w.reshape(w.shape[0], -1, 32)
    assert np.array_equal(d.mins, groups.min(axis=2))  # the float min of each group is a grid point
    assert np.allclose(d.scales, (groups.max(axis=2) - groups.min(axis=2)) / 15)


@pytest.mark.parametrize("group", [64, 128])
def test_wider_groups_take_gptqs_grid_where_zero_is_exact(group):
    w = _weights()  # 320 inputs: the last group of 128 is shorter (64)
    d = quantize_int4(w, group)
    assert d.format == f"int4-g{group}"
    rtn = gptq.rtn(w, group)
    assert np.array_equal(d.q, rtn.q) and np.array_equal(d.scales, rtn.scales) and np.array_equal(d.mins, rtn.mins)
    back = d.dequantize()
    assert np.all(back[:, ::7] == 0.0)  # a zero weight stays exactly zero: no bias from the grid
    zeros = -d.mins / d.scales
    assert np.allclose(zeros, np.rint(zeros))  # an integer zero point per group
    assert np.abs(back - w).max() <= 0.5 * np.repeat(d.scales, group, axis=1)[:, : w.shape[1]].max() * 1.001


def test_q4_1s_grid_at_128_would_move_zero_weights():
    # Why the wider groups leave Q4_1's grid: with a float min, 0 is rarely a grid point,
    # so every zero (and near-zero) weight of a group moves by the same offset.
    w = _weights()
    groups = w.reshape(w.shape[0], -1, 64)
    lo, hi = groups.min(axis=2), groups.max(axis=2)
    scale = (hi - lo) / 15
    offset = np.abs(lo + np.rint(-lo / scale) * scale)  # where Q4_1's grid puts a zero weight
    assert np.median(offset) > 0.1 * np.median(scale)
