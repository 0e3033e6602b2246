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


def _tree_case(head_dim: int, committed: int, kv_dtype: torch.dtype, seed: int):
    """A sequence of ``committed`` positions in scattered blocks, six tree
    nodes' KV at the slot positions after it, and a second block table whose
    blocks hold the same prefix with one root-to-node path (nodes 1, 4, 5)
    laid out at its positions: what a plain decode of that path reads."""
    from workers.model.attention import kv_int8

    torch.manual_seed(seed)
    bs, hkv = 16, 3
    width = (committed + 8) // bs + 1
    perm = torch.randperm(2 * width + 4)
    table_a, table_b = perm[:width].to(torch.int32), perm[width : 2 * width].to(torch.int32)
    values = torch.randn(2, 2 * width + 4, bs, hkv, head_dim)
    cache = kv_int8.quantize(values) if kv_dtype == torch.int8 else values
    flat = cache.view(2, -1, *cache.shape[3:])

    def slot(table: torch.Tensor, p: int) -> int:
        return int(table[p // bs]) * bs + p % bs

    path = [slot(table_a, committed + i) for i in (1, 4, 5)]
    for p in range(committed):
        flat[:, slot(table_b, p)] = flat[:, slot(table_a, p)]
    for depth, s in enumerate(path):
        flat[:, slot(table_b, committed + depth)] = flat[:, s]
    return cache, table_a, table_b, path


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=["f32", "int8"])
@pytest.mark.parametrize("head_dim,committed,window", [(64, 37, None), (12, 37, None), (64, 700, None),
                                                       (64, 700, 600), (64, 511, None)],
                         ids=["fast", "generic", "split_chunks", "window", "chunk_edge"])
def test_tree_rows_read_their_own_path(head_dim, committed, window, kv_dtype):
    # Tree verification: a row whose positions from tail_lo on come from listed
    # slots (its path through the tree) gives exactly what a plain decode of a
    # sequence holding that path at its positions gives, whatever kernel path
    # (vectorized, generic, split into chunks, windowed, int8 cache); rows
    # without a tail (-1) read their table as before.
    from workers.model.attention import cpu_decode

    cache, table_a, table_b, path = _tree_case(head_dim, committed, kv_dtype, seed=head_dim + committed)
    lib = cpu_decode.load(kv_dtype)
    q = torch.randn(4, 9, head_dim)
    n = committed
    lens = torch.tensor([n + 3, n + 2, n + 3, n + 1], dtype=torch.int32)
    tables = torch.stack([table_a, table_a, table_b, table_a])
    tail_lo = torch.tensor([n, n, -1, n], dtype=torch.int32)
    tail_slots = torch.tensor([path, path[:2] + [0], [0] * 3, path[:1] + [0, 0]], dtype=torch.int64)
    scale = 1 / math.sqrt(head_dim)
    out = cpu_decode.paged_decode(lib, q, cache, tables, lens, scale, window, tails=(tail_lo, tail_slots))
    plain = cpu_decode.paged_decode(lib, q, cache, table_b.expand(4, -1).contiguous(), lens, scale, window)
    assert torch.equal(out, plain)
    # The test can fail: read through the table, the tree rows see other nodes.
    assert not torch.equal(cpu_decode.paged_decode(lib, q, cache, tables, lens, scale, window)[0], plain[0])
    if kv_dtype == torch.float32:  # the torch path (no compiler) reads the same slots
        from workers.model.attention.base import AttentionMetadata

        meta = AttentionMetadata.build([0] * 4, [1] * 4, lens.tolist(), tables.tolist())
        meta.tree_tails = (tail_lo, tail_slots)
        torch_out = TorchAttentionBackend(native_decode=False)._decode(q, cache, meta, scale, window)
        torch.testing.assert_close(torch_out, plain, atol=1e-5, rtol=1e-5)


def test_int8_kv_rows_are_the_same_bytes_whichever_path_writes_them():
    # Prefill chunks quantize in torch (kv_int8.write), decodes in the native kernel: the same
    # token's row must be bitwise the same either way, or outputs would depend on the scheduling
    # (a recompute preemption re-prefills tokens first written by decodes).
    from workers.model.attention import cpu_decode, kv_int8

    lib = cpu_decode.load(torch.int8)
    if lib is None:
        pytest.skip("no C compiler: the native kernel is not built")
    torch.manual_seed(5)
    blocks, bs, hkv, dim, rows = 1024, 16, 3, 64, 16384  # ~6M values: a few near-ties among them
    k = torch.randn(rows, hkv, dim) * torch.rand(rows, 1, 1) * 8
    v = torch.randn(rows, hkv, dim) * torch.rand(rows, 1, 1) * 8
    slots = torch.randperm(blocks * bs)[:rows]
    width = kv_int8.row_width(dim)
    by_torch = torch.zeros(2, blocks, bs, hkv, width, dtype=torch.int8)
    kv_int8.write(k, v, by_torch, slots)
    by_kernel = torch.zeros_like(by_torch)
    tables = (slots // bs).to(torch.int32).view(rows, 1)
    lens = (slots % bs + 1).to(torch.int32)
    q = torch.randn(rows, 9, dim)
    cpu_decode.paged_decode(lib, q, by_kernel, tables, lens, 0.125, None, new_kv=(k, v, slots))
    assert torch.equal(by_kernel, by_torch)
