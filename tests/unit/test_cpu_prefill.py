"""The native prefill kernel (``cpu_prefill``, AVX-512) against the dense reference."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from tests.attention_cases import make_paged_case, reference
from workers.model.attention import cpu_prefill
from workers.model.attention.base import AttentionMetadata, write_kv
from workers.model.attention.torch_backend import TorchAttentionBackend

LIB = cpu_prefill.load()
needs_kernel = pytest.mark.skipif(LIB is None, reason="the native prefill kernel needs AVX-512F and a C compiler")


def _run(case, scale, window, requests):
    write_kv(case.k, case.v, case.kv_cache, case.meta.slot_mapping)
    out = torch.full_like(case.q, float("nan"))
    cpu_prefill.paged_prefill(LIB, case.q, case.kv_cache, case.meta.block_tables, case.meta.query_start_loc,
                              case.meta.seq_lens, scale, window, out, requests)
    return out


def test_the_kernel_is_built_on_a_cpu_with_avx512():
    # The fast path must not silently vanish where it can run.
    if not cpu_prefill._has_avx512():
        pytest.skip("no AVX-512F here")
    assert LIB is not None


@needs_kernel
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("hq,hkv,head_dim,block_size", [
    (9, 3, 64, 16),    # the default model's shape: 5 positions x 3 heads per task
    (4, 4, 32, 4),     # no GQA, 16 positions per task, blocks shorter than a key tile
    (6, 2, 128, 16),   # head_dim 128 (two 64-column chunks)
    (16, 1, 80, 24),   # a group of 16 (one position per task), head_dim not a multiple of 64, odd blocks
    (4, 1, 16, 2),
])
def test_prefill_chunks_match_the_dense_reference(hq, hkv, head_dim, block_size, window):
    # Three decodes (left alone), a fresh prompt, chunks after cached context
    # (one starting mid-block), and a long prompt spanning many key tiles.
    seq_lens = [1, 7, 17, 12, 9, 23, 70, 150]
    query_lens = [1, 1, 1, 12, 4, 23, 33, 150]
    case = make_paged_case(seq_lens, query_lens, block_size, hq, hkv, head_dim, seed=hq * 7 + head_dim)
    scale = 1 / math.sqrt(head_dim)
    out = _run(case, scale, window, (3, len(seq_lens)))
    assert torch.isnan(out[:3]).all()  # rows of other requests are not written
    torch.testing.assert_close(out[3:], reference(case, scale, window)[3:], atol=1e-5, rtol=1e-5)


@needs_kernel
def test_a_requests_rows_do_not_depend_on_the_rest_of_the_step():
    rng = random.Random(3)
    seq_lens = [rng.randint(20, 90) for _ in range(6)]
    query_lens = [n - rng.randint(0, 15) for n in seq_lens]
    case = make_paged_case(seq_lens, query_lens, 16, 9, 3, 64, seed=11)
    together = _run(case, 0.125, None, (0, 6))
    qlen = query_lens[2]
    start = sum(query_lens[:2])
    alone = _run(case, 0.125, None, (2, 3))[start : start + qlen]
    assert torch.equal(alone, together[start : start + qlen])


@needs_kernel
def test_the_backend_serves_a_mixed_step_with_it():
    # Decodes through the decode kernel, the prefill chunks in one native call:
    # the same result as the torch path, and the kernel was the one used.
    seq_lens, query_lens = [5, 40, 18, 33], [1, 1, 18, 9]
    case = make_paged_case(seq_lens, query_lens, 16, 9, 3, 64, seed=2)
    backend = TorchAttentionBackend()
    out = backend.forward(case.q, case.k, case.v, case.kv_cache.clone(), case.meta, 0.125, None)
    assert any(lib is not None for lib in backend._prefill_layouts.values())
    torch_out = TorchAttentionBackend(native_prefill=False).forward(case.q, case.k, case.v, case.kv_cache.clone(),
                                                                    case.meta, 0.125, None)
    torch.testing.assert_close(out, torch_out, atol=1e-5, rtol=1e-5)


def test_unsupported_layouts_fall_back_to_torch():
    cache = torch.zeros(2, 4, 16, 2, 12)
    assert not cpu_prefill.supports(torch.zeros(3, 4, 12), cache)  # head_dim not a multiple of 16
    assert not cpu_prefill.supports(torch.zeros(3, 34, 16), torch.zeros(2, 4, 16, 2, 16))  # group of 17
    assert not cpu_prefill.supports(torch.zeros(3, 4, 16), torch.zeros(2, 4, 16, 2, 16, dtype=torch.int8))
    assert cpu_prefill.supports(torch.zeros(3, 4, 16), torch.zeros(2, 4, 16, 2, 16))


@needs_kernel
@pytest.mark.parametrize("block_size,window", [(16, None), (16, 37), (32, 37), (24, None), (4, 9)])
def test_a_prompt_gives_the_same_bits_however_it_is_chunked(block_size, window):
    # Key tiles are cut at absolute positions and masked keys add exact
    # zeros, so a row's result does not depend on the chunk (or query tile)
    # that carries it: one 90-token prefill against chunks of 7, 40 and 43.
    full = make_paged_case([90], [90], block_size, 9, 3, 64, seed=21)
    whole = _run(full, 0.125, window, (0, 1))
    pieces, done = [], 0
    for qlen in (7, 40, 43):
        done += qlen  # the same request with its first done - qlen keys cached: a chunk with context
        meta = AttentionMetadata.build(full.meta.slot_mapping[done - qlen : done].tolist(), [qlen], [done],
                                       full.meta.block_tables.tolist())
        chunk = SimpleNamespace(kv_cache=full.kv_cache, meta=meta,
                                **{name: getattr(full, name)[done - qlen : done] for name in ("q", "k", "v")})
        pieces.append(_run(chunk, 0.125, window, (0, 1)))
    assert torch.equal(torch.cat(pieces), whole)
