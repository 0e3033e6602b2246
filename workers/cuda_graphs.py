"""CUDA graphs for decode steps (``enforce_eager=False`` on a GPU).

A decode step of a small model on a GPU is bound by kernel launches (a few
hundred per step), not by the GPU. A CUDA graph replays the whole forward
with one launch. Graphs need fixed shapes and fixed addresses, so:

- **Batch-size buckets** (vLLM's): 1, 2, 4, then every multiple of 8 up to
  ``max_num_seqs`` (at most 512). A step of n decodes replays the smallest
  bucket >= n; larger steps, and any step with a prefill chunk, run eagerly.
- **Persistent input buffers** sized for the largest bucket: token ids,
  positions, slot mapping, sequence lengths and block tables as wide as
  ``max_model_len`` needs. A step copies its inputs into their first n rows
  and pads the rest.
- **Padding rows** are decodes of length 1 whose one slot lies in a block of
  their own (the runner allocates one block past the scheduler's pool), so
  they never touch a request's KV; their outputs are dropped.

Graphs are captured once, at start-up, largest first into one memory pool;
the time it takes is logged. The attention backend must read only device
tensors in a decode step (the ``triton`` backend does; ``auto`` picks it on a
GPU without flash-attn). Tensor parallelism runs eagerly.

The graph API is injectable: ``tests/unit/test_cuda_graphs.py`` runs the
bucket, buffer and padding logic on CPU with a fake graph that replays the
captured forward eagerly on the same buffers.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any, Callable, Optional

import torch

from workers.model.attention.base import AttentionMetadata

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The buckets captured for ``max_num_seqs``: 1, 2, 4, 8, 16, 24, ... up to it."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [b for b in (1, 2, 4) if b <= top] + list(range(8, top + 1, 8))
    if top > sizes[-1]:
        sizes.append(top)  # e.g. max_num_seqs 12: a bucket of 12 rather than eager at 9..12
    return sizes


def pick_bucket(num_rows: int, sizes: list[int]) -> Optional[int]:
    """The smallest bucket holding ``num_rows`` decodes, or None (run eagerly)."""
    i = bisect.bisect_left(sizes, num_rows)
    return sizes[i] if i < len(sizes) else None


class TorchGraphs:
    """The CUDA graph calls (real)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """Runs ``fn`` twice eagerly (warm-up: lazy inits, Triton compiles), then
        captures it; returns the graph and the output tensor it writes."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        torch.cuda.synchronize(self.device)
        return graph, out

    @staticmethod
    def replay(graph: Any) -> None:
        graph.replay()


class DecodeGraphs:
    """Captured decode forwards, one per batch-size bucket.

    Args:
        model: ``forward(input_ids, positions, kv_caches, meta) -> hidden``.
        kv_caches: The runner's caches (one block past the scheduler's pool).
        block_size: Tokens per block.
        pad_block: The block padding rows write into and read from.
        max_blocks_per_seq: Block-table width (``max_model_len / block_size``).
        sizes: Buckets (``graph_batch_sizes``).
        device: Where the buffers live.
        graphs: The graph API (``TorchGraphs`` on a GPU; a fake in tests).
    """

    def __init__(self, model: Any, kv_caches: list[torch.Tensor], *, block_size: int, pad_block: int,
                 max_blocks_per_seq: int, sizes: list[int], device: torch.device, graphs: Any = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.pad_block = pad_block
        self.pad_slot = pad_block * block_size
        self.sizes = sizes
        self.device = device
        self.graphs = graphs if graphs is not None else TorchGraphs(device)
        top = sizes[-1]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((top,), self.pad_slot, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(top, dtype=torch.int32, device=device)
        self.block_tables = torch.full((top, max_blocks_per_seq), pad_block, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int32, device=device)
        self._captured: dict[int, tuple[Any, torch.Tensor]] = {}
        self.num_replays = 0

    @property
    def max_blocks_per_seq(self) -> int:
        return self.block_tables.shape[1]

    def _meta(self, rows: int) -> AttentionMetadata:
        """Metadata whose tensors are views of the buffers (what a graph reads)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:rows], query_start_loc=self.query_start_loc[: rows + 1],
            seq_lens=self.seq_lens[:rows], block_tables=self.block_tables[:rows], query_lens_list=[1] * rows,
            seq_lens_list=[1] * rows, max_query_len=1, max_seq_len=1, num_decodes=rows)

    def capture(self) -> float:
        """Captures every bucket, largest first (smaller ones reuse its pool); returns the seconds taken."""
        began = time.perf_counter()
        self._pad(0)
        for rows in reversed(self.sizes):
            meta = self._meta(rows)

            def forward(rows: int = rows, meta: AttentionMetadata = meta) -> torch.Tensor:
                return self.model(self.input_ids[:rows], self.positions[:rows], self.kv_caches, meta)

            self._captured[rows] = self.graphs.capture(forward)
        seconds = time.perf_counter() - began
        logger.info("CUDA graphs: %d decode batch sizes (1..%d) captured in %.1f s", len(self.sizes),
                    self.sizes[-1], seconds)
        return seconds

    def can_run(self, meta: AttentionMetadata) -> bool:
        """A decode-only step that fits a captured bucket and the block-table width."""
        n = meta.num_requests
        return (bool(self._captured) and meta.max_query_len == 1 and meta.num_decodes == n
                and meta.tree_tails is None and pick_bucket(n, self.sizes) is not None
                and meta.block_tables.shape[1] <= self.max_blocks_per_seq)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The step's hidden states ``[n, hidden]``: inputs copied into the
        buffers, the rest padded, the bucket's graph replayed."""
        n = meta.num_requests
        rows = pick_bucket(n, self.sizes)
        assert rows is not None and rows in self._captured, (n, self.sizes)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self._pad(n)
        graph, out = self._captured[rows]
        self.graphs.replay(graph)
        self.num_replays += 1
        return out[:n]

    def _pad(self, n: int) -> None:
        """Rows from ``n`` on: length-1 decodes of token 0 in the pad block."""
        self.input_ids[n:].zero_()
        self.positions[n:].zero_()
        self.slot_mapping[n:].fill_(self.pad_slot)
        self.seq_lens[n:].fill_(1)
        self.block_tables[n:].fill_(self.pad_block)
