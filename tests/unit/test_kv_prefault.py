"""The KV cache's pages committed at start (``CacheConfig.kv_cache_prefault``)."""

import torch

from tests.factories import resident_bytes
from workers.kv_memory import lazy_zeros, prefault

MiB = 2**20


def test_prefault_commits_every_page_and_keeps_the_zeros():
    caches = [lazy_zeros((2, 1280, 16, 2, 64), torch.float32, torch.device("cpu")) for _ in range(2)]  # 40 MiB each
    for cache in caches:  # pages the allocator handed over resident (a reused part of the heap) are dropped first
        _drop_pages(cache)
    assert all(resident_bytes(c) < MiB for c in caches)  # nothing committed now
    prefault(caches)
    assert all(resident_bytes(c) >= c.numel() * 4 for c in caches)
    assert all(int(torch.count_nonzero(c)) == 0 for c in caches)


def _drop_pages(tensor: torch.Tensor) -> None:
    """madvise(MADV_DONTNEED) over the tensor's whole pages: they read as zeros again, uncommitted."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = -(-tensor.data_ptr() // page) * page
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page * page
    assert libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), 4) == 0, ctypes.get_errno()


def test_int8_caches_prefault_too_and_a_strided_view_is_refused():
    cache = lazy_zeros((2, 256, 16, 1, 72), torch.int8, torch.device("cpu"))
    prefault([cache])
    assert resident_bytes(cache) >= cache.numel() and int(torch.count_nonzero(cache)) == 0
    import pytest

    with pytest.raises(ValueError, match="contiguous"):
        prefault([torch.zeros(64, 64)[:, ::2]])
