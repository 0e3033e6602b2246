"""The Triton paged-decode kernel (interpreted on CPU) and the backend factory.

Triton picks interpretation when a kernel is decorated, so TRITON_INTERPRET
is set before anything imports the kernel module. Cases stay small: the
interpreter runs each program in numpy, one tile at a time.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.attention_cases import make_paged_case, reference  # noqa: E402
from workers.model.attention import get_attention_backend  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed: the Triton backend cannot be tested")

from workers.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

from workers.model.attention.torch_backend import TorchAttentionBackend  # noqa: E402


# Ragged lengths cross block (and 64-token tile) boundaries; 1 is a first token.
DECODE_CASES = [
    # block_size, hq, hkv, head_dim, seq_lens, window
    (16, 4, 4, 32, [1, 16, 17, 70], None),
    (4, 6, 2, 24, [3, 9, 33], 7),
    (8, 8, 2, 16, [130, 5, 64, 65], 40),
    (1, 4, 1, 16, [1, 6, 11], None),
    # Flash-decoding splits of 512 positions: one split exactly, two, three; windows across a cut.
    (16, 4, 2, 32, [512, 513, 1100, 3], None),
    (16, 2, 1, 16, [1100, 700, 40], 600),
    (32, 2, 2, 16, [1030, 520], 100),
]


def test_mixed_batch_splits_decodes_and_prefill_chunks():
    # Two decodes, a chunk with cached context, a fresh prompt.
    seq_lens, query_lens = [20, 3, 14, 6], [1, 1, 5, 6]
    case = make_paged_case(seq_lens, query_lens, 4, 6, 2, 16, seed=3, table_padding=1)
    out = TritonAttentionBackend().forward(case.q, case.k, case.v, case.kv_cache, case.meta, 0.25, 9)
    torch.testing.assert_close(out, reference(case, 0.25, 9), atol=1e-5, rtol=1e-5)


# Prefill chunks: fresh prompts and chunks after a cached prefix, lengths across
# the 32-row / 32-key tiles, any block size, GQA, sliding windows shorter and
# longer than a chunk.
PREFILL_CASES = [
    # block_size, hq, hkv, head_dim, seq_lens, query_lens, window
    (16, 4, 4, 32, [40, 17, 5], [40, 17, 5], None),
    (16, 6, 2, 24, [70, 33, 20], [37, 1, 20], None),
    (4, 4, 1, 16, [50, 9], [30, 9], 7),
    (1, 2, 2, 16, [35, 12], [35, 4], 40),
    (8, 8, 2, 64, [66], [66], 20),
]


@pytest.mark.parametrize("block_size, hq, hkv, head_dim, seq_lens, query_lens, window",
                         [(b, hq, hkv, d, lens, [1] * len(lens), w) for b, hq, hkv, d, lens, w in DECODE_CASES]
                         + PREFILL_CASES)
def test_kernels_match_references(block_size, hq, hkv, head_dim, seq_lens, query_lens, window):
    order = sorted(range(len(seq_lens)), key=lambda i: query_lens[i] != 1)  # decodes first, as the runner does
    seq_lens, query_lens = [seq_lens[i] for i in order], [query_lens[i] for i in order]
    case = make_paged_case(seq_lens, query_lens, block_size, hq, hkv, head_dim, seed=hq + head_dim + block_size,
                           table_padding=2)
    scale = 1 / math.sqrt(head_dim)
    torch_cache = case.kv_cache.clone()
    out = TritonAttentionBackend().forward(case.q, case.k, case.v, case.kv_cache, case.meta, scale, window)
    torch.testing.assert_close(out, reference(case, scale, window), atol=1e-5, rtol=1e-5)
    # The new keys and values were written to their slots.
    flat = case.kv_cache.view(2, -1, hkv, head_dim)
    slots = case.meta.slot_mapping
    assert torch.equal(flat[0, slots], case.k) and torch.equal(flat[1, slots], case.v)
    expected = TorchAttentionBackend().forward(case.q, case.k, case.v, torch_cache, case.meta, scale, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_prefill_kernel_in_float16_is_close_to_float32():
    # 16-bit dots: float16 here (the interpreter mishandles bfloat16, numpy has none; tests/gpu covers it).
    case = make_paged_case([45, 20], [30, 20], 16, 4, 2, 32, seed=11)
    scale = 32 ** -0.5
    want = reference(case, scale, None)
    cast = [t.to(torch.float16) for t in (case.q, case.k, case.v, case.kv_cache)]
    out = TritonAttentionBackend().forward(cast[0], cast[1], cast[2], cast[3], case.meta, scale, None)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), want, atol=5e-3, rtol=5e-3)


class RecordingBackend:
    """A stand-in fallback that records what it was asked to run."""

    name = "recording"

    def __init__(self):
        self.calls = []

    def forward(self, q, k, v, kv_cache, meta, scale, sliding_window=None):
        self.calls.append(meta)
        return torch.zeros_like(q)


def test_prefill_part_gets_rebased_metadata():
    seq_lens, query_lens = [9, 4, 7], [1, 3, 7]
    case = make_paged_case(seq_lens, query_lens, 4, 2, 2, 16, seed=4, table_padding=1)
    meta = case.meta
    fallback = RecordingBackend()
    TritonAttentionBackend(fallback=fallback).forward(case.q, case.k, case.v, case.kv_cache, meta, 0.25)
    (sub,) = fallback.calls
    assert sub.query_start_loc.tolist() == [0, 3, 10]
    assert sub.seq_lens_list == [4, 7] and sub.query_lens_list == [3, 7]
    assert torch.equal(sub.slot_mapping, meta.slot_mapping[1:])
    assert torch.equal(sub.block_tables, meta.block_tables[1:]) and sub.num_decodes == 0
    assert (sub.max_query_len, sub.max_seq_len) == (7, 7)


def test_factory_names_and_errors(monkeypatch):
    assert get_attention_backend("torch", "cpu").name == "torch"
    assert get_attention_backend("auto", "cpu").name == "torch"
    assert get_attention_backend("triton", "cpu").name == "triton"  # interpreter is on
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="CUDA"):
        get_attention_backend("triton", "cpu")
    with pytest.raises(ValueError, match="CUDA"):
        get_attention_backend("flash_attn", "cpu")
    with pytest.raises(ValueError, match="auto.*torch.*triton.*flash_attn"):
        get_attention_backend("flash", "cpu")


def test_backends_import_without_triton_or_flash_attn():
    # None in sys.modules makes `import triton` raise ImportError.
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['flash_attn'] = None\n"
        "import workers.model.attention as attention\n"
        "import workers.model.attention.triton_backend, workers.model.attention.flash_attn_backend\n"
        "assert attention.get_attention_backend('auto', 'cpu').name == 'torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


def test_missing_flash_attn_names_the_gpu_extra(monkeypatch):
    from workers.model.attention.flash_attn_backend import FlashAttnBackend

    monkeypatch.setitem(sys.modules, "flash_attn", None)
    with pytest.raises(ImportError, match=r"pip install 'prefixserve\[gpu\]'"):
        FlashAttnBackend()


# Compiles the kernel (not interpreted) to a cubin for sm80 and sm90 with the
# ptxas that ships in the triton wheel: no GPU needed. Catches what the
# interpreter lets through (types across branches, dot shapes, dtypes).
_COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from workers.model.attention import triton_decode
from workers.model.attention.triton_decode import _launch_config, _paged_decode_kernel as kernel
import torch

names = kernel.arg_names
for dtype, head_dim, group, window, arch in [
    (torch.bfloat16, 64, 3, True, 90), (torch.float32, 128, 4, False, 80), (torch.float16, 80, 1, True, 80)
]:
    ty = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    signature = {name: "i32" for name in names}
    signature.update({name: "*" + ty for name in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")})
    signature.update(partial_ptr="*fp32", block_tables_ptr="*i32", seq_lens_ptr="*i32", scale="fp32")
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n, num_warps = _launch_config(dtype, block_d)
    consts = dict(HEAD_DIM=head_dim, GROUP=group, KV_BLOCK_SIZE=16, BLOCK_D=block_d, BLOCK_H=16,
                  BLOCK_N=block_n, HAS_WINDOW=window, DOT_PRECISION="tf32x3", SPLIT=512, MAX_SPLITS=8)
    signature.update({name: "constexpr" for name in consts})
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    assert compiled.asm["cubin"], "no cubin"
    merge = triton_decode._merge_splits_kernel
    signature = {name: "i32" for name in merge.arg_names}
    signature.update(out_ptr="*" + ty, partial_ptr="*fp32", seq_lens_ptr="*i32")
    consts = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, SPLIT=512, MAX_SPLITS=8, HAS_WINDOW=window)
    signature.update({name: "constexpr" for name in consts})
    source = ASTSource(fn=merge, signature=signature,
                       constexprs={(merge.arg_names.index(n),): v for n, v in consts.items()})
    assert triton.compile(source, target=GPUTarget("cuda", arch, 32)).asm["cubin"], "no merge cubin"

from workers.model.attention import triton_prefill
kernel = triton_prefill._paged_prefill_kernel
names = kernel.arg_names
for dtype, head_dim, group, window, arch in [
    (torch.bfloat16, 64, 3, True, 90), (torch.float32, 128, 4, False, 80), (torch.float16, 80, 1, True, 90)
]:
    ty = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    signature = {name: "i32" for name in names[7:]}
    signature.update({name: "*" + ty for name in names[:4]})
    signature.update(block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_ptr="*i32", scale="fp32")
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m, block_n, num_warps = triton_prefill._launch_config(dtype, block_d)
    consts = dict(HEAD_DIM=head_dim, GROUP=group, KV_BLOCK_SIZE=16, BLOCK_M=block_m, BLOCK_N=block_n,
                  BLOCK_D=block_d, HAS_WINDOW=window, DOT_PRECISION="tf32x3")
    signature.update({name: "constexpr" for name in consts})
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    assert compiled.asm["cubin"], "no prefill cubin"
print("compiled")
"""


def test_kernel_compiles_for_cuda_without_a_gpu():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    # Skip only where triton's offline API or ptxas is missing (a module without the name, no file);
    # any other error, e.g. a kernel's signature out of step with the script, fails.
    last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
    api_or_tool_missing = ("ImportError", "ModuleNotFoundError", "FileNotFoundError", "AttributeError: module ")
    if result.returncode and last.startswith(api_or_tool_missing):
        pytest.skip(f"cannot compile Triton kernels offline here: {result.stderr.strip().splitlines()[-1]}")
    assert result.returncode == 0, result.stderr
