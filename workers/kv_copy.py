"""KV blocks out of and into a model runner's cache, as one host array.

The cache is one tensor per layer, ``(2, blocks, block_size, kv_heads,
row)`` (``workers/model/attention/base.py``; ``row`` is ``head_dim``, or
an int8 row and its scale with ``kv_cache_dtype="int8"``). A transfer
carries the blocks of every layer as one contiguous array of raw bytes::

    data[layer, k_or_v, i, token, head, byte]     i: the i-th block sent
    shape (num_layers, 2, n, block_size, kv_heads, row * element size), uint8

Raw bytes, so float32, float16, bfloat16 (which NumPy lacks) and int8 rows
travel alike, and a NumPy array goes through Ray's object store without a
pickle copy. Sender and receiver must agree on ``KVLayout``; the receiver
checks it before it writes anything.

On CPU both copies are NumPy's (``np.take``, an indexed assignment), not
torch's: they run on worker threads, and a torch op there that goes parallel
gives that thread an OpenMP team of its own, which the thread keeps; once the
process holds more OpenMP threads than cores, libgomp stops spin-waiting and
every region of the engine thread's decode step pays a sleep and a wake-up
(``workers/engine/async_engine.py``). After one torch read on a kept worker
thread the engine's batch-1 step was 21.3 ms (median of three alternated
runs) against 17.2 without it and 16.5 after a NumPy read. NumPy reads on one
core: 23.6 MB in 4.4 ms, against 2.6 ms on torch's two threads.

A CPU read copies straight into a reused host buffer (``StagingPool``), one
copy per layer and no stacking: memory the process just got from the OS is
backed page by page at its first write, and a fresh 23.6 MB array for each
export (512 tokens of the default model) made the read 24-33 ms instead of
2-3 (``scripts/bench_kv_transfer.py``, docs/KV_TRANSFER.md). A buffer goes
back to the pool when the last array viewing it is gone (after Ray copied it
into the object store), never while anything can still read it.
"""

from __future__ import annotations

import collections
import ctypes
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class KVLayout:
    """What one block of a runner's cache looks like (equal on both ends of a transfer)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    row: int
    dtype: str

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across the layers (keys and values)."""
        elem = torch.tensor([], dtype=getattr(torch, self.dtype)).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.row * elem

    def array_shape(self, num_blocks: int) -> tuple[int, ...]:
        elem = torch.tensor([], dtype=getattr(torch, self.dtype)).element_size()
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.row * elem)


def layout_of(runner: Any) -> KVLayout:
    """The layout of ``runner.kv_caches`` (a ``ModelRunner``'s)."""
    cache = runner.kv_caches[0]
    _, _, block_size, num_kv_heads, row = cache.shape
    return KVLayout(len(runner.kv_caches), block_size, num_kv_heads, row, str(cache.dtype).removeprefix("torch."))


class StagingPool:
    """Host buffers that ``read_blocks`` copies into, kept and reused.

    ``take`` hands out the smallest free buffer that fits (or a new one) as
    a NumPy array whose memory nothing else is given until that array and
    every view of it are gone; then the buffer comes back (at most
    ``max_buffers`` are kept, none over ``max_buffer_bytes``).
    """

    def __init__(self, max_buffers: int = 4, max_buffer_bytes: int = 256 << 20) -> None:
        self.max_buffers = max_buffers
        self.max_buffer_bytes = max_buffer_bytes
        self._free: list[torch.Tensor] = []
        self._returned: collections.deque[torch.Tensor] = collections.deque()  # appended by finalizers
        self._lock = threading.Lock()
        self.allocated = 0  # buffers made, for tests and the bench

    def take(self, shape: Sequence[int]) -> np.ndarray:
        """A uint8 array of ``shape`` on a pooled buffer."""
        nbytes = int(np.prod(shape))
        buf: Optional[torch.Tensor] = None
        with self._lock:
            while self._returned:
                self._keep(self._returned.popleft())
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        if buf is None:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            self.allocated += 1
        lease = (ctypes.c_uint8 * nbytes).from_buffer(buf.numpy())  # the views' owner: holds buf
        weakref.finalize(lease, self._returned.append, buf)
        return np.frombuffer(lease, dtype=np.uint8).reshape(tuple(shape))

    def _keep(self, buf: torch.Tensor) -> None:
        if buf.numel() > self.max_buffer_bytes:
            return
        self._free.append(buf)
        if len(self._free) > self.max_buffers:  # list.remove would compare tensors by value
            self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))


STAGING = StagingPool()


def read_blocks(runner: Any, block_ids: Sequence[int]) -> np.ndarray:
    """A copy of ``block_ids``' KV in every layer, as the module doc's array
    (on a ``STAGING`` buffer for a CPU cache).

    Safe off the engine thread while the blocks are pinned: a full cached
    block is never written again.
    """
    caches = runner.kv_caches
    ids = list(block_ids)
    if caches[0].device.type != "cpu":
        index = torch.tensor(ids, dtype=torch.long, device=caches[0].device)
        with torch.inference_mode():
            stacked = torch.stack([cache.index_select(1, index) for cache in caches])
            return _as_bytes(stacked).cpu().numpy()
    array = STAGING.take(layout_of(runner).array_shape(len(ids)))
    for layer, cache in enumerate(caches):  # a block's keys (values) are one run of bytes
        np.take(_host_blocks(cache), ids, axis=1, out=array[layer].reshape(2, len(ids), -1))
    return array


def write_blocks(runner: Any, block_ids: Sequence[int], data: np.ndarray) -> None:
    """Writes ``data`` (``read_blocks``' array, maybe read-only: Ray's object
    store hands out read-only views) into ``block_ids`` of every layer.

    Raises:
        ValueError: ``data`` does not have this runner's layout for
            ``len(block_ids)`` blocks (nothing was written).
    """
    layout = layout_of(runner)
    expected = layout.array_shape(len(block_ids))
    if data.dtype != np.uint8 or tuple(data.shape) != expected:
        raise ValueError(f"KV data of shape {tuple(data.shape)} {data.dtype} does not fit this cache: "
                         f"expected {expected} uint8 ({layout})")
    caches = runner.kv_caches
    device = caches[0].device
    if device.type == "cpu":
        ids = np.asarray(list(block_ids), dtype=np.int64)
        for layer, cache in enumerate(caches):
            _host_blocks(cache)[:, ids] = data[layer].reshape(2, len(ids), -1)
        return
    with warnings.catch_warnings():  # a read-only view: torch warns, and it is only read
        warnings.simplefilter("ignore", UserWarning)
        source = torch.from_numpy(data)
    index = torch.tensor(list(block_ids), dtype=torch.long, device=device)
    with torch.inference_mode():
        for layer, cache in enumerate(caches):
            values = source[layer].to(device, non_blocking=False).view(cache.dtype)
            cache.index_copy_(1, index, values)


def _host_blocks(cache: torch.Tensor) -> np.ndarray:
    """A CPU cache's memory as NumPy bytes, ``(2, blocks, bytes of a block's keys or values)``;
    a view (torch's ``view`` raises where it would take a copy, which writes would miss)."""
    return cache.detach().view(torch.uint8).view(2, cache.shape[1], -1).numpy()


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as uint8, the last dimension widened by the element size."""
    return tensor.contiguous().view(torch.uint8)


class RankKVCopies:
    """The copies on a tensor-parallel rank (mixed into ``RankWorker``): each
    rank reads and writes its own heads' shard of the same block ids, so a
    transfer between two replicas of the same ``tensor_parallel_size`` goes
    rank to rank (``workers/kv_transfer.py``)."""

    runner: Any

    def kv_layout(self) -> KVLayout:
        return layout_of(self.runner)

    def read_kv(self, block_ids: Sequence[int]) -> np.ndarray:
        return read_blocks(self.runner, block_ids)

    def write_kv(self, block_ids: Sequence[int], data: np.ndarray, skip: int = 0) -> None:
        """Writes ``data``'s blocks from the ``skip``-th on into ``block_ids``."""
        write_blocks(self.runner, block_ids, data[:, :, skip:])
