"""The KV cache's pages committed at start (``CacheConfig.kv_cache_prefault``)."""

import torch

from tests.factories import resident_bytes
from workers.kv_memory import lazy_zeros, prefault

MiB = 2**20


def test_prefault_commits_every_page_and_keeps_the_zeros():
    caches = [lazy_zeros((2, 1280, 16, 2, 64), torch.float32, torch.device("cpu")) for _ in range(2)]  # 40 MiB each:
    # above glibc's largest mmap threshold (32 MiB), so fresh pages, never a reused part of the heap
    assert all(resident_bytes(c) < MiB for c in caches)  # lazily committed: nothing written yet
    prefault(caches)
    assert all(resident_bytes(c) >= c.numel() * 4 for c in caches)
    assert all(int(torch.count_nonzero(c)) == 0 for c in caches)


def test_int8_caches_prefault_too_and_a_strided_view_is_refused():
    cache = lazy_zeros((2, 256, 16, 1, 72), torch.int8, torch.device("cpu"))
    prefault([cache])
    assert resident_bytes(cache) >= cache.numel() and int(torch.count_nonzero(cache)) == 0
    import pytest

    with pytest.raises(ValueError, match="contiguous"):
        prefault([torch.zeros(64, 64)[:, ::2]])
