"""The attention-backend interface and the paged KV layout every backend shares.

KV cache of one layer (one tensor; ``kv[0]`` keys, ``kv[1]`` values)::

    kv: [2, num_blocks, block_size, num_kv_heads, head_dim]

    slot s = block_id * block_size + offset      (flat index into blocks)

This is flash-attn's ``k_cache``/``v_cache`` layout, so the flash backend uses
the tensors as they are. A batch mixes prefill chunks and decodes; tokens of
request i are ``q[query_start_loc[i] : query_start_loc[i+1]]``, with positions
``seq_lens[i] - query_lens[i] ... seq_lens[i] - 1`` (earlier positions are
already in the cache). Backends first write the new K/V at ``slot_mapping``,
then attend each query over positions ``0 .. its own`` of its request (causal),
limited to the last ``sliding_window`` positions when one is set.
"""

from __future__ import annotations

from dataclasses import dataclass
import itertools
from typing import Optional, Protocol, Sequence, Union

import torch


@dataclass
class AttentionMetadata:
    """Per-step batch layout, built once by the runner, shared by all layers.

    Attributes:
        slot_mapping: [T] int64, cache slot of each new token.
        query_start_loc: [B+1] int32, cumulative query lengths.
        seq_lens: [B] int32, context length of each request after this step.
        block_tables: [B, max_blocks] int32, padded with 0.
        query_lens_list / seq_lens_list: the same on the host (no syncs).
        max_query_len / max_seq_len: maxima of the lists.
        num_decodes: requests with query length 1 come first in the batch
            when the runner orders them so (``decodes_first``); backends may
            use a fast decode path for ``[0, num_decodes)``.
        tree_tails: Tree verification (``workers/engine/spec_decode.py``):
            ``(tail_lo [B] int32, tail_slots [B, W] int64)``. A decode row
            with ``tail_lo >= 0`` attends positions ``tail_lo ..`` at the
            slots ``tail_slots[row, p - tail_lo]`` (its own path through the
            tree of proposals) rather than through its block table; -1 for
            every other row. None in a step without a tree.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_lens_list: list[int]
    seq_lens_list: list[int]
    max_query_len: int
    max_seq_len: int
    num_decodes: int = 0
    tree_tails: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_list)

    @classmethod
    def build(
        cls,
        slot_mapping: Sequence[int],
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        device: Union[str, torch.device] = "cpu",
    ) -> "AttentionMetadata":
        """Builds the metadata from host lists, deriving everything derivable.

        Block tables are padded with block 0 to the longest; ``num_decodes``
        is the leading run of requests with query length 1.
        """
        query_lens, seq_lens = list(query_lens), list(seq_lens)
        width = max(len(t) for t in block_tables)
        tables = [list(t) + [0] * (width - len(t)) for t in block_tables]
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        return cls(
            slot_mapping=host_to_device(slot_mapping, torch.long, device),
            query_start_loc=host_to_device(starts, torch.int32, device),
            seq_lens=host_to_device(seq_lens, torch.int32, device),
            block_tables=host_to_device(tables, torch.int32, device),
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            num_decodes=sum(1 for _ in itertools.takewhile(lambda n: n == 1, query_lens)),
        )


class AttentionBackend(Protocol):
    """One attention implementation over the paged KV cache."""

    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: Optional[int] = None,
        softcap: Optional[float] = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Writes k/v into the cache at ``meta.slot_mapping``, then attends;
        with ``softcap`` (Gemma 2) the scores are ``tanh(s / softcap) * softcap``
        before the mask and softmax (the torch backend only; callers pass it
        only when set)."""
        ...


def host_to_device(values: Sequence, dtype: torch.dtype, device: Union[str, torch.device]) -> torch.Tensor:
    """A step's host list as a tensor on ``device``. On a GPU the list goes
    through pinned memory with a non-blocking copy, so building a step's
    inputs does not wait for the GPU (a pageable copy synchronizes); the
    caching host allocator keeps the pinned block until the copy has run."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Stores the new keys and values at their slots (in place; quantized into an int8 cache)."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, kv_cache.shape[3], kv_cache.shape[4])
    if kv_cache.dtype == torch.int8:
        from workers.model.attention import kv_int8

        k, v = kv_int8.quantize(k), kv_int8.quantize(v)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)
