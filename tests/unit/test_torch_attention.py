"""The torch paged-attention backend against a dense reference."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tests.attention_cases import make_paged_case, reference
from workers.model.attention.torch_backend import TorchAttentionBackend


@pytest.mark.parametrize("native", [True, False], ids=["native_decode", "torch_decode"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (9, 3), (4, 1)])
def test_mixed_batch_matches_dense_reference(hq, hkv, window, native):
    seq_lens = [1, 7, 17, 12, 9, 23]
    query_lens = [1, 1, 1, 12, 4, 23]  # 3 decodes, a fresh prompt, a chunk with context, a long prompt
    case = make_paged_case(seq_lens, query_lens, 4, hq, hkv, 8, seed=hq * 10 + hkv)
    scale = 1 / math.sqrt(8)
    out = TorchAttentionBackend(native_decode=native).forward(
        case.q, case.k, case.v, case.kv_cache, case.meta, scale, window
    )
    torch.testing.assert_close(out, reference(case, scale, window), atol=1e-5, rtol=1e-5)


def test_new_keys_are_written_to_their_slots():
    case = make_paged_case([5, 3], [1, 3], 2, 2, 2, 4, seed=1)
    TorchAttentionBackend().forward(case.q, case.k, case.v, case.kv_cache, case.meta, 0.5)
    flat = case.kv_cache.view(2, -1, 2, 4)
    assert torch.equal(flat[0, case.meta.slot_mapping], case.k) and torch.equal(flat[1, case.meta.slot_mapping], case.v)


def test_many_decodes_in_several_groups_of_any_order(monkeypatch):
    # Groups of a few requests each, lengths unsorted (the runner sorts for
    # speed; correctness must not depend on it).
    from workers.model.attention import torch_backend

    monkeypatch.setattr(torch_backend, "DECODE_GROUP_BYTES", 2 * 2 * 8 * 4 * 30)
    backend = TorchAttentionBackend(native_decode=False)
    rng = random.Random(7)
    seq_lens = [rng.randint(1, 40) for _ in range(37)] + [15]
    query_lens = [1] * 37 + [6]
    case = make_paged_case(seq_lens, query_lens, 4, 6, 2, 8, seed=3)
    out = backend.forward(case.q, case.k, case.v, case.kv_cache, case.meta, 0.3, 9)
    torch.testing.assert_close(out, reference(case, 0.3, 9), atol=1e-5, rtol=1e-5)


def test_native_decode_kernel_is_built_here():
    # These machines have a C compiler: the fast path must not silently vanish.
    from workers.model.attention import cpu_decode

    assert cpu_decode.load() is not None


@pytest.mark.parametrize("head_dim", [64, 72, 12], ids=["d64", "d72_tail_chunk", "d12_generic"])
@pytest.mark.parametrize("num_reqs", [1, 2, 9], ids=["one_head_per_task", "heads_split", "all_heads_per_task"])
@pytest.mark.parametrize("window", [None, 21])
def test_native_decode_kernel_shapes(head_dim, num_reqs, window):
    # The native kernel's vectorized path (head_dim a multiple of 8; value
    # chunks of 64 plus a tail) and its generic one, with requests split over
    # tasks by head ranges of every size, 16-token blocks, lengths that end
    # mid-block and a window that starts mid-block.
    from workers.model.attention import cpu_decode

    rng = random.Random(num_reqs * 100 + head_dim)
    seq_lens = [rng.randint(1, 70) for _ in range(num_reqs - 1)] + [67]
    case = make_paged_case(seq_lens, [1] * num_reqs, 16, 9, 3, head_dim, seed=head_dim + num_reqs)
    scale = 1 / math.sqrt(head_dim)
    lib = cpu_decode.load()
    out = cpu_decode.paged_decode(lib, case.q, case.kv_cache, case.meta.block_tables, case.meta.seq_lens, scale,
                                  window, new_kv=(case.k, case.v, case.meta.slot_mapping))
    torch.testing.assert_close(out, reference(case, scale, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 700])
@pytest.mark.parametrize("num_reqs", [1, 5])
def test_native_decode_long_sequences_split_into_chunks(num_reqs, window):
    # Sequences past the kernel's 512-position chunk are attended chunk by
    # chunk and merged; one request with 3 KV heads also splits heads 2 + 1
    # (uneven head ranges). A request's output must not depend on its
    # batch-mates: the chunk cuts follow its own positions.
    from workers.model.attention import cpu_decode

    rng = random.Random(num_reqs)
    seq_lens = [1300] + [rng.choice([1, 511, 512, 513, 1025]) for _ in range(num_reqs - 1)]
    case = make_paged_case(seq_lens, [1] * num_reqs, 16, 9, 3, 64, seed=5 + num_reqs)
    scale = 0.125
    lib = cpu_decode.load()
    out = cpu_decode.paged_decode(lib, case.q, case.kv_cache, case.meta.block_tables, case.meta.seq_lens, scale,
                                  window, new_kv=(case.k, case.v, case.meta.slot_mapping))
    torch.testing.assert_close(out, reference(case, scale, window), atol=1e-5, rtol=1e-5)
    alone = cpu_decode.paged_decode(lib, case.q[:1], case.kv_cache, case.meta.block_tables[:1],
                                    case.meta.seq_lens[:1], scale, window)
    assert torch.equal(alone, out[:1])
