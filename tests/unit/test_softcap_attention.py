"""Soft-capped paged attention (Gemma 2, ``workers/model/attention/softcap.py``) against a dense
reference, one query at a time: decodes in groups, a chunk with cached context, a first chunk, GQA,
a sliding window, and query rows split into chunks."""

from __future__ import annotations

import random

import pytest
import torch

from workers.model.attention import softcap
from workers.model.attention.base import AttentionMetadata
from workers.model.attention.torch_backend import TorchAttentionBackend

HQ, HKV, HD, BS = 4, 2, 8, 4


def _reference(q, keys, values, positions, scale, window, cap):
    """Per query row: capped scores over keys[0 .. its position] (within the window), softmax, values."""
    out = torch.empty_like(q)
    for t, pos in enumerate(positions):
        lo = 0 if window is None else max(0, pos - window + 1)
        k = keys[lo : pos + 1].repeat_interleave(HQ // HKV, 1)  # [L, Hq, hd]
        v = values[lo : pos + 1].repeat_interleave(HQ // HKV, 1)
        s = torch.einsum("hd,lhd->hl", q[t], k) * scale
        s = torch.tanh(s / cap) * cap
        out[t] = torch.einsum("hl,lhd->hd", torch.softmax(s, -1), v)
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_mixed_step_matches_a_dense_reference(window, monkeypatch):
    monkeypatch.setattr(softcap, "SCORE_BYTES", 4 * HQ * 20 * 3)  # a few query rows per chunk
    monkeypatch.setattr(softcap, "DECODE_GROUP_BYTES", 2 * (2 * 4 * 13 * HKV * HD))  # two decodes per group
    torch.manual_seed(0)
    rng = random.Random(0)
    # (context already cached, new tokens): three decodes, a chunk after 7 cached tokens, a first chunk.
    requests = [(12, 1), (9, 1), (4, 1), (7, 10), (0, 13)]
    num_blocks = 1 + sum(-(-(c + n) // BS) for c, n in requests)
    ids = list(range(1, num_blocks))
    rng.shuffle(ids)
    kv_cache = torch.zeros(2, num_blocks, BS, HKV, HD)
    tables, slot_mapping, full_kv, new_k, new_v = [], [], [], [], []
    for cached, new in requests:
        length = cached + new
        table = [ids.pop() for _ in range(-(-length // BS))]
        tables.append(table)
        keys, values = torch.randn(length, HKV, HD), torch.randn(length, HKV, HD)
        full_kv.append((keys, values))
        slots = [table[p // BS] * BS + p % BS for p in range(length)]
        flat = kv_cache.view(2, -1, HKV, HD)
        flat[0, slots[:cached]], flat[1, slots[:cached]] = keys[:cached], values[:cached]
        slot_mapping += slots[cached:]
        new_k.append(keys[cached:])
        new_v.append(values[cached:])
    meta = AttentionMetadata.build(slot_mapping, [n for _, n in requests], [c + n for c, n in requests], tables)
    assert meta.num_decodes == 3
    q = torch.randn(len(slot_mapping), HQ, HD) * 3
    out = TorchAttentionBackend().forward(q, torch.cat(new_k), torch.cat(new_v), kv_cache, meta, 0.5, window,
                                          softcap=2.0)
    start = 0
    for (cached, new), (keys, values) in zip(requests, full_kv):
        want = _reference(q[start : start + new], keys, values, range(cached, cached + new), 0.5, window, 2.0)
        torch.testing.assert_close(out[start : start + new], want, atol=1e-5, rtol=0)
        start += new
