"""The fused Triton norm, rotary and SiLU kernels (interpreted on CPU) against
the torch code of ``layers.py``, and compiled for CUDA offline.

TRITON_INTERPRET is set before anything defines the kernels.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed: the fused Triton kernels cannot be tested")

from workers.model import triton_ops  # noqa: E402
from workers.model.layers import RMSNorm, RotaryEmbedding, SiluAndMul  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def ops():
    loaded = triton_ops.load(torch.device("cpu"))
    assert loaded is not None, "the interpreter should run the kernels on CPU"
    return loaded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens, hidden", [(1, 576), (5, 96), (3, 100)])
def test_add_rms_norm_matches_torch(ops, dtype, tokens, hidden):
    gen = torch.Generator().manual_seed(hidden + tokens)
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    norm.weight.data = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    residual = (torch.randn(tokens, hidden, generator=gen) * 3).to(dtype)
    want_res = residual.clone()
    want = norm(x, want_res)
    got_res = residual.clone()
    got = ops.add_rms_norm(x, got_res, norm.weight, norm.eps)
    assert got.dtype == dtype
    # The sum is rounded like residual.add_(x): exactly, except that the interpreter (numpy has no
    # bfloat16) may round a bf16 result the other way, one unit in the last place.
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 0
    torch.testing.assert_close(got_res.float(), want_res.float(), atol=0, rtol=ulp)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    # Without x: the norm alone, the residual untouched.
    before = residual.clone()
    torch.testing.assert_close(ops.add_rms_norm(None, residual, norm.weight, norm.eps).float(),
                               norm(before).float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(residual, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, hq, hkv, dim", [(1, 9, 3, 64), (4, 4, 4, 32), (3, 6, 2, 80)])
def test_rotary_in_place_matches_torch(ops, dtype, tokens, hq, hkv, dim):
    gen = torch.Generator().manual_seed(dim + hq)
    rope = RotaryEmbedding(dim, 64, 10000.0).to(dtype)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    cos, sin = rope.lookup(positions)
    # q and k as views into a fused qkv row, as the attention module rotates them.
    qkv = torch.randn(tokens, (hq + 2 * hkv) * dim, generator=gen).to(dtype)
    qk = qkv[:, : (hq + hkv) * dim].view(tokens, hq + hkv, dim)
    want = RotaryEmbedding.apply(qk.clone(), cos, sin)
    v_before = qkv[:, (hq + hkv) * dim:].clone()
    ops.rotary(qk, cos, sin)
    torch.testing.assert_close(qk.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(qkv[:, (hq + hkv) * dim:], v_before), "v must not be touched"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, inter", [(1, 1536), (3, 40), (2, 2500)])
def test_silu_and_mul_matches_torch(ops, dtype, tokens, inter):
    gen = torch.Generator().manual_seed(inter)
    x = (torch.randn(tokens, 2 * inter, generator=gen) * 4).to(dtype)
    want = SiluAndMul()(x)
    got = ops.silu_and_mul(x)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_zero_tokens_launch_nothing(ops):
    empty = torch.empty(0, 64)
    assert ops.add_rms_norm(None, empty, torch.ones(64), 1e-6).shape == (0, 64)
    assert ops.silu_and_mul(torch.empty(0, 64)).shape == (0, 32)
    ops.rotary(torch.empty(0, 2, 64), torch.empty(0, 32), torch.empty(0, 32))


def test_not_loaded_where_triton_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    assert triton_ops.load(torch.device("cpu")) is None


# Each kernel compiled (not interpreted) to a cubin for sm90 with the ptxas of
# the triton wheel: no GPU needed; catches what the interpreter lets through.
_COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from workers.model import triton_ops

k = triton_ops._build()
cases = [
    (k.add_rms_norm, {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32"},
     {"HAS_X": True, "BLOCK": 1024}),
    (k.add_rms_norm, {"x_ptr": "*fp32", "res_ptr": "*fp32", "w_ptr": "*fp32", "out_ptr": "*fp32", "eps": "fp32"},
     {"HAS_X": False, "BLOCK": 1024}),
    (k.rotary, {"qk_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16"},
     {"HALF": 64, "BLOCK_H": 64, "BLOCK_HALF": 64}),
    (k.silu_and_mul, {"x_ptr": "*fp16", "out_ptr": "*fp16"}, {"BLOCK": 1024}),
]
for kernel, types, consts in cases:
    names = kernel.arg_names
    signature = {name: types.get(name, "i32") for name in names}
    signature.update({name: "constexpr" for name in consts})
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert compiled.asm["cubin"], "no cubin"
print("compiled")
"""


def test_kernels_compile_for_cuda_without_a_gpu():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], cwd=REPO_ROOT, env=env, capture_output=True,
                            text=True)
    # Skip only where triton's offline API or ptxas is missing (a module without the name, no file);
    # any other error, e.g. a kernel's signature out of step with the script, fails.
    last = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
    api_or_tool_missing = ("ImportError", "ModuleNotFoundError", "FileNotFoundError", "AttributeError: module ")
    if result.returncode and last.startswith(api_or_tool_missing):
        pytest.skip(f"cannot compile Triton kernels offline here: {result.stderr.strip().splitlines()[-1]}")
    assert result.returncode == 0, result.stderr


def _greedy_with(llm, fused, prompts):
    from cluster.shared.types import SamplingParams
    from workers.model.layers import RMSNorm as Norm, SiluAndMul as Silu
    from workers.model.self_attention import LlamaAttention

    model = llm.runner.model
    model.native_decoder = None  # it calls kernels without the modules
    for module in model.modules():
        if isinstance(module, (Norm, Silu, LlamaAttention)):
            module.native, module.fused = None, fused
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    return [o.token_ids for o in outs]


def test_model_with_fused_ops_gives_the_torch_tokens(ops, tmp_path):
    from tests.factories import make_tiny_model_dir
    from workers.llm import LLM

    model_dir = make_tiny_model_dir("qwen2", tmp_path / "tiny")  # biases, GQA
    llm = LLM(str(model_dir), linear_backend="torch", num_kv_blocks=64, max_num_seqs=4)
    prompts = [[5, 9, 23, 4, 7], [1, 2, 3], list(range(40, 60))]
    assert _greedy_with(llm, ops, prompts) == _greedy_with(llm, None, prompts)
