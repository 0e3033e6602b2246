"""Paged-attention cases shared by the backend tests (torch on CPU, Triton in
the interpreter, Triton and flash-attn on CUDA): a batch over a shuffled
(non-contiguous) paged cache, decodes first, and a float64 dense reference.

A request of ``seq_len`` tokens with a query of ``qlen`` has its first
``seq_len - qlen`` keys / values already in the cache; the step's new K/V are
returned for the backend to write at ``meta.slot_mapping``. Blocks not used by
any request hold random values, so a backend that reads outside its table is
caught.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from cluster.shared.sizes import cdiv
from workers.model.attention.base import AttentionMetadata


@dataclass
class PagedCase:
    """One batch: the cache, its metadata, the step's q/k/v and each request's full K/V."""

    kv_cache: torch.Tensor  # [2, num_blocks, block_size, hkv, head_dim]
    meta: AttentionMetadata
    q: torch.Tensor  # [T, hq, head_dim]
    k: torch.Tensor  # [T, hkv, head_dim]
    v: torch.Tensor
    full: list[tuple[torch.Tensor, torch.Tensor]]  # per request: keys, values [seq_len, hkv, head_dim]

    def to(self, device: str) -> "PagedCase":
        meta = AttentionMetadata.build(self.meta.slot_mapping.tolist(), self.meta.query_lens_list,
                                       self.meta.seq_lens_list, self.meta.block_tables.tolist(), device=device)
        return PagedCase(self.kv_cache.to(device), meta, self.q.to(device), self.k.to(device), self.v.to(device),
                         [(k.to(device), v.to(device)) for k, v in self.full])


def make_paged_case(seq_lens: Sequence[int], query_lens: Sequence[int], block_size: int, hq: int, hkv: int,
                    head_dim: int, seed: int, extra_blocks: int = 3, table_padding: int = 0) -> PagedCase:
    """A mixed batch (decodes first when the caller lists them first) on CPU.

    Args:
        extra_blocks: Blocks beyond those the requests use (random contents).
        table_padding: Entries of block 0 appended to every block table, past
            what the requests use (backends must not read them).
    """
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(cdiv(n, block_size) for n in seq_lens) + extra_blocks
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    kv_cache = torch.randn(2, num_blocks, block_size, hkv, head_dim, generator=gen)
    flat = kv_cache.view(2, -1, hkv, head_dim)
    tables, slots, full, qs, ks, vs = [], [], [], [], [], []
    for seq_len, qlen in zip(seq_lens, query_lens):
        blocks = [free.pop() for _ in range(cdiv(seq_len, block_size))]
        tables.append(blocks + [0] * table_padding)
        keys = torch.randn(seq_len, hkv, head_dim, generator=gen)
        values = torch.randn(seq_len, hkv, head_dim, generator=gen)
        full.append((keys, values))
        seq_slots = [blocks[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        ctx = seq_len - qlen
        flat[0, seq_slots[:ctx]], flat[1, seq_slots[:ctx]] = keys[:ctx], values[:ctx]
        slots += seq_slots[ctx:]
        qs.append(torch.randn(qlen, hq, head_dim, generator=gen))
        ks.append(keys[ctx:])
        vs.append(values[ctx:])
    meta = AttentionMetadata.build(slots, query_lens, seq_lens, tables)
    return PagedCase(kv_cache, meta, torch.cat(qs), torch.cat(ks), torch.cat(vs), full)


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: Sequence[int],
                    scale: float, window: Optional[int]) -> torch.Tensor:
    """Each query (at its position) over keys ``0 .. position`` (the last
    ``window`` of them with a sliding window), in float64."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    outs = []
    for qi, pos in zip(q.double(), positions):
        lo = 0 if window is None else max(0, pos - window + 1)
        weights = (torch.einsum("hd,lhd->hl", qi, k[lo : pos + 1]) * scale).softmax(-1)
        outs.append(torch.einsum("hl,lhd->hd", weights, v[lo : pos + 1]))
    return torch.stack(outs).to(q.dtype)


def reference(case: PagedCase, scale: float, window: Optional[int]) -> torch.Tensor:
    """The dense reference output of the whole batch, in the batch's token order."""
    outs, start = [], 0
    for (keys, values), seq_len, qlen in zip(case.full, case.meta.seq_lens_list, case.meta.query_lens_list):
        positions = range(seq_len - qlen, seq_len)
        outs.append(dense_attention(case.q[start : start + qlen], keys, values, positions, scale, window))
        start += qlen
    return torch.cat(outs)
