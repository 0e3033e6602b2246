"""The torch paged-attention backend against a dense reference."""

from __future__ import annotations

import math
import random

import pytest
import torch

from workers.model.attention.base import AttentionMetadata
from workers.model.attention.torch_backend import TorchAttentionBackend


def dense_reference(q_all, k_all, v_all, q_positions, scale, window):
    """Attention of queries at q_positions over keys 0..pos (dense, float64)."""
    hq, hkv = q_all.shape[1], k_all.shape[1]
    rep = hq // hkv
    k = k_all.double().repeat_interleave(rep, dim=1)
    v = v_all.double().repeat_interleave(rep, dim=1)
    outs = []
    for qi, pos in zip(q_all.double(), q_positions):
        lo = 0 if window is None else max(0, pos - window + 1)
        scores = torch.einsum("hd,lhd->hl", qi, k[lo : pos + 1]) * scale
        outs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v[lo : pos + 1]))
    return torch.stack(outs).float()


def make_case(seq_lens, query_lens, block_size, num_blocks, hq, hkv, hd, seed):
    """Builds a mixed batch: decodes (query 1) first, then prefill chunks.

    Earlier context of each request is written into the cache directly; the
    step's new K/V are passed to the backend, which must write them itself.
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    kv_cache = torch.zeros(2, num_blocks, block_size, hkv, hd)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, slots, full = [], [], []
    q_parts, k_parts, v_parts, q_pos = [], [], [], []
    for seq_len, qlen in zip(seq_lens, query_lens):
        blocks = [free.pop() for _ in range(-(-seq_len // block_size))]
        tables.append(blocks)
        keys = torch.randn(seq_len, hkv, hd, generator=gen)
        vals = torch.randn(seq_len, hkv, hd, generator=gen)
        full.append((keys, vals))
        for pos in range(seq_len):
            slot = blocks[pos // block_size] * block_size + pos % block_size
            if pos < seq_len - qlen:
                kv_cache[0].view(-1, hkv, hd)[slot] = keys[pos]
                kv_cache[1].view(-1, hkv, hd)[slot] = vals[pos]
            else:
                slots.append(slot)
        q_parts.append(torch.randn(qlen, hq, hd, generator=gen))
        k_parts.append(keys[seq_len - qlen :])
        v_parts.append(vals[seq_len - qlen :])
        q_pos.append(list(range(seq_len - qlen, seq_len)))
    meta = AttentionMetadata.build(slots, query_lens, seq_lens, tables)
    return kv_cache, meta, q_parts, k_parts, v_parts, q_pos, full


@pytest.mark.parametrize("native", [True, False], ids=["native_decode", "torch_decode"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (9, 3), (4, 1)])
def test_mixed_batch_matches_dense_reference(hq, hkv, window, native):
    seq_lens = [1, 7, 17, 12, 9, 23]
    query_lens = [1, 1, 1, 12, 4, 23]  # 3 decodes, a fresh prompt, a chunk with context, a long prompt
    kv_cache, meta, qs, ks, vs, q_pos, full = make_case(seq_lens, query_lens, 4, 40, hq, hkv, 8, seed=hq * 10 + hkv)
    scale = 1 / math.sqrt(8)
    out = TorchAttentionBackend(native_decode=native).forward(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), kv_cache, meta, scale, window
    )
    start = 0
    for i, (q, pos) in enumerate(zip(qs, q_pos)):
        ref = dense_reference(q, full[i][0], full[i][1], pos, scale, window)
        torch.testing.assert_close(out[start : start + len(pos)], ref, atol=1e-5, rtol=1e-5)
        start += len(pos)


def test_new_keys_are_written_to_their_slots():
    kv_cache, meta, qs, ks, vs, _, _ = make_case([5, 3], [1, 3], 2, 8, 2, 2, 4, seed=1)
    TorchAttentionBackend().forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), kv_cache, meta, 0.5)
    flat_k = kv_cache[0].view(-1, 2, 4)
    torch.testing.assert_close(flat_k[meta.slot_mapping], torch.cat(ks))


def test_many_decodes_in_several_groups_of_any_order(monkeypatch):
    # Groups of a few requests each, lengths unsorted (the runner sorts for
    # speed; correctness must not depend on it).
    from workers.model.attention import torch_backend

    monkeypatch.setattr(torch_backend, "DECODE_GROUP_BYTES", 2 * 2 * 8 * 4 * 30)
    backend = TorchAttentionBackend(native_decode=False)
    rng = random.Random(7)
    seq_lens = [rng.randint(1, 40) for _ in range(37)] + [15]
    query_lens = [1] * 37 + [6]
    kv_cache, meta, qs, ks, vs, q_pos, full = make_case(seq_lens, query_lens, 4, 400, 6, 2, 8, seed=3)
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), kv_cache, meta, 0.3, 9)
    start = 0
    for i, (q, pos) in enumerate(zip(qs, q_pos)):
        ref = dense_reference(q, full[i][0], full[i][1], pos, 0.3, 9)
        torch.testing.assert_close(out[start : start + len(pos)], ref, atol=1e-5, rtol=1e-5)
        start += len(pos)


def test_native_decode_kernel_is_built_here():
    # These machines have a C compiler: the fast path must not silently vanish.
    from workers.model.attention import cpu_decode

    assert cpu_decode.load() is not None
