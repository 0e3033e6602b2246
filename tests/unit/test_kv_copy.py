"""Blocks out of one runner's cache and into another's (workers/kv_copy.py):
byte-exact for float32, bfloat16 and int8 rows, other blocks untouched, and
a mismatched array refused before anything is written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from workers.kv_copy import KVLayout, layout_of, read_blocks, write_blocks


class CacheOnly:
    """What the copies read of a ``ModelRunner``: its per-layer KV tensors."""

    def __init__(self, num_blocks: int, dtype: torch.dtype, row: int = 8, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        shape = (2, num_blocks, 4, 3, row)
        if dtype == torch.int8:
            self.kv_caches = [torch.randint(-128, 127, shape, generator=gen, dtype=torch.int8) for _ in range(2)]
        else:
            self.kv_caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_blocks_arrive_byte_exact_where_the_receiver_put_them(dtype):
    holder, receiver = CacheOnly(6, dtype, seed=1), CacheOnly(5, dtype, seed=2)
    before = [c.clone() for c in receiver.kv_caches]
    data = read_blocks(holder, [4, 1])
    elem = torch.tensor([], dtype=dtype).element_size()
    assert data.dtype == np.uint8 and data.shape == (2, 2, 2, 4, 3, 8 * elem)
    assert data.flags["C_CONTIGUOUS"]
    data.setflags(write=False)  # as Ray's object store hands it out
    write_blocks(receiver, [0, 3], data)
    for layer in range(2):
        got, src, old = receiver.kv_caches[layer], holder.kv_caches[layer], before[layer]
        assert torch.equal(got[:, 0].view(torch.uint8), src[:, 4].view(torch.uint8))
        assert torch.equal(got[:, 3].view(torch.uint8), src[:, 1].view(torch.uint8))
        for untouched in (1, 2, 4):
            assert torch.equal(got[:, untouched], old[:, untouched])


def test_layout_and_block_bytes():
    layout = layout_of(CacheOnly(3, torch.float32))
    assert layout == KVLayout(num_layers=2, block_size=4, num_kv_heads=3, row=8, dtype="float32")
    assert layout.block_bytes == 2 * 2 * 4 * 3 * 8 * 4
    assert layout_of(CacheOnly(3, torch.int8, row=10)).block_bytes == 2 * 2 * 4 * 3 * 10


def test_a_mismatched_array_writes_nothing():
    holder, receiver = CacheOnly(4, torch.int8), CacheOnly(4, torch.float32, seed=3)
    before = [c.clone() for c in receiver.kv_caches]
    with pytest.raises(ValueError, match="does not fit"):
        write_blocks(receiver, [0], read_blocks(holder, [0]))  # int8 rows into a float32 cache
    with pytest.raises(ValueError, match="does not fit"):
        write_blocks(receiver, [0, 1], read_blocks(CacheOnly(4, torch.float32), [0]))  # 1 block for 2
    assert all(torch.equal(a, b) for a, b in zip(receiver.kv_caches, before))


def _expected(holder: CacheOnly, block_ids: list[int]) -> np.ndarray:
    return torch.stack([c[:, block_ids] for c in holder.kv_caches]).contiguous().view(torch.uint8).numpy()


def test_a_read_reuses_a_staging_buffer_only_once_every_view_of_the_last_is_gone():
    import gc

    from workers.kv_copy import StagingPool

    holder = CacheOnly(6, torch.float32, seed=3)
    pool = StagingPool()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("workers.kv_copy.STAGING", pool)
        first = read_blocks(holder, [4, 1])
        tail = first[:, :, 1:]  # a view of the first read: its buffer must stay its own
        del first
        gc.collect()
        second = read_blocks(holder, [0, 2])
        assert pool.allocated == 2  # the first buffer was still viewed: a new one
        np.testing.assert_array_equal(tail, _expected(holder, [1]))
        np.testing.assert_array_equal(second, _expected(holder, [0, 2]))
        del tail, second
        gc.collect()
        third = read_blocks(holder, [5])  # smaller: fits a returned buffer
        assert pool.allocated == 2
        np.testing.assert_array_equal(third, _expected(holder, [5]))


def test_the_staging_pool_keeps_at_most_its_cap_and_no_oversized_buffer():
    import gc

    from workers.kv_copy import StagingPool

    pool = StagingPool(max_buffers=2, max_buffer_bytes=1000)
    arrays = [pool.take((100 * (i + 1),)) for i in range(3)] + [pool.take((5000,))]
    del arrays
    gc.collect()
    pool.take((1,))  # collects what came back: the two largest under the cap are kept, then one is lent
    assert sorted(b.numel() for b in pool._free) == [300]
    assert pool.allocated == 4


def test_copies_on_a_kept_worker_thread_start_no_openmp_team_there():
    """The copies run on worker threads that live on (``asyncio.to_thread``). A
    torch op there that goes parallel leaves that thread an OpenMP team, and more
    OpenMP threads than cores slow every later step of the engine thread
    (module doc): the CPU copies start no thread."""
    import concurrent.futures
    import os

    if torch.get_num_threads() < 2:
        pytest.skip("one torch thread: no OpenMP team is started anyway")
    holder, receiver = CacheOnly(80, torch.float32, row=64, seed=5), CacheOnly(80, torch.float32, row=64, seed=6)
    ids = list(range(3, 67))  # 2 x 64 x 4 x 3 x 64 values a layer: past torch's grain, it would go parallel
    with concurrent.futures.ThreadPoolExecutor(1) as worker:
        worker.submit(lambda: None).result()
        before = len(os.listdir("/proc/self/task"))
        data = worker.submit(read_blocks, holder, ids).result()
        worker.submit(write_blocks, receiver, ids, data).result()
        after = len(os.listdir("/proc/self/task"))
    assert after == before
    for layer in range(2):
        assert torch.equal(receiver.kv_caches[layer][:, ids], holder.kv_caches[layer][:, ids])
