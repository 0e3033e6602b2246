"""Mixture-of-experts layers (``workers/model/moe.py``) beyond the parity with
transformers (``test_llama.py``, ``tests/engine/test_parity.py``): only the
routed experts run, a token's output does not depend on its batch-mates, the
router stays float32 under quantization, what is not supported says so, and
tensor parallelism splits every expert (tokens with TP=2:
``tests/integration/test_tensor_parallel.py``)."""

from __future__ import annotations

import pytest
import torch

from tests.factories import make_hf_config, make_hf_model
from tests.models.conftest import save_hf_model
from workers.model.attention.torch_backend import TorchAttentionBackend
from workers.model.loader import load_model
from workers.model.moe import SparseMoE


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    return save_hf_model(make_hf_model(make_hf_config("mixtral")), tmp_path_factory.mktemp("mixtral"))


def _moe(model) -> SparseMoE:
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, SparseMoE) and len(mlp.experts) == 8 and mlp.top_k == 2
    return mlp


def test_only_the_routed_experts_run(mixtral_dir):
    model, _ = load_model(mixtral_dir, "float32", "cpu", TorchAttentionBackend())
    moe = _moe(model)
    moe.native = None  # the torch loop, whose expert modules the hooks see (the native layer: below)
    calls: list[int] = []
    for i, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda mod, inp, out, i=i: calls.append((i, inp[0].shape[0])))
    x = torch.randn(3, model.arch.hidden_size)
    _, ids = moe.route(x)
    moe(x)
    assert sorted(i for i, _ in calls) == sorted(set(ids.flatten().tolist()))  # each chosen expert once
    assert sum(n for _, n in calls) == 3 * 2  # every token through exactly its two experts


def test_a_tokens_output_does_not_depend_on_its_batch(mixtral_dir):
    model, _ = load_model(mixtral_dir, "float32", "cpu", TorchAttentionBackend(), linear_backend="native")
    moe = _moe(model)
    x = torch.randn(9, model.arch.hidden_size, generator=torch.Generator().manual_seed(0))
    together = moe(x)
    for i in range(x.shape[0]):
        assert torch.equal(moe(x[i : i + 1])[0], together[i]), i  # bitwise, alone or with 8 others


@pytest.mark.parametrize("family,quantization", [("mixtral", None), ("mixtral", "int4"), ("qwen2_moe", None)])
def test_the_native_layer_gives_the_torch_loops_bits(family, quantization, tmp_path):
    folder = save_hf_model(make_hf_model(make_hf_config(family)), tmp_path)
    model, _ = load_model(folder, "float32", "cpu", TorchAttentionBackend(), linear_backend="native",
                          quantization=quantization)
    moe = model.model.layers[0].mlp
    assert isinstance(moe, SparseMoE)
    if moe.native is None:
        pytest.skip("a native kernel did not build here")
    x = torch.randn(9, model.arch.hidden_size, generator=torch.Generator().manual_seed(2))
    weights, ids = moe.route(x)  # the native routing: torch's softmax, top-k and renormalisation to float rounding
    probs = torch.softmax(moe.gate(x), dim=-1)
    expected_weights, expected_ids = torch.topk(probs, 2, dim=-1)
    if moe.norm_topk_prob:
        expected_weights = expected_weights / expected_weights.sum(dim=-1, keepdim=True)
    assert torch.equal(ids, expected_ids)
    assert torch.allclose(weights, expected_weights, rtol=1e-6, atol=1e-7)
    shared_inter = moe.native.struct.shared_inter
    assert (shared_inter > 0) == (moe.shared_expert is not None)  # Qwen2-MoE's shared expert in the same call
    if shared_inter:
        gate = torch.sigmoid(moe.shared_expert_gate(x))  # torch's sigmoid: C's 1 / (1 + expf(-g)) to an ulp
        with_shared = moe.native.forward(x)
        expected = moe.routed_loop(x, weights, ids) + gate * moe.shared_expert(x)
        assert torch.allclose(with_shared, expected, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(with_shared, moe.routed_loop(x, weights, ids), rtol=1e-3, atol=1e-4)
        for i in (0, 5):
            assert torch.equal(moe.native.forward(x[i : i + 1])[0], with_shared[i])  # alone or with 8 others
        moe.native.struct.shared_inter = 0  # the routed part alone: below
    routed = moe.native.forward(x)
    assert torch.equal(routed, moe.routed_loop(x, weights, ids))  # one C call: the loop's kernels, order, bits
    assert (moe.native.struct.panel_width > 0) == (quantization is not None)  # quantized: qgemm's panel ranges
    assert moe.native.struct.gemm_panel_width > 0  # the experts' GEMMs grouped in one parallel region (either kind)
    moe.native.fns.qgemm_panels = moe.native.fns.gemm_panels = None  # one GEMM call per expert instead: same bits
    assert torch.equal(moe.native.forward(x), routed)
    for i in (0, 5):
        assert torch.equal(moe.native.forward(x[i : i + 1])[0], routed[i])  # alone or with 8 others
    moe.native.struct.dense = 1  # bench moe's baseline: every expert on every token, weight 0 where not chosen
    assert torch.equal(moe.native.forward(x), routed)
    moe.native.struct.dense = 0
    moe.native.struct.shared_inter = shared_inter


def test_int4_quantizes_the_experts_and_keeps_the_router_float(mixtral_dir):
    model, _ = load_model(mixtral_dir, "float32", "cpu", TorchAttentionBackend(), quantization="int4")
    moe = _moe(model)
    assert moe.gate.quant is None  # which experts run is decided in float32
    assert all(e.gate_up_proj.quant is not None and e.down_proj.quant is not None for e in moe.experts)


def test_unsupported_quantization_says_what_works(mixtral_dir):
    with pytest.raises(ValueError, match="not supported for mixture-of-experts models .*'int8', 'int4' or 'gguf'"):
        load_model(mixtral_dir, "float32", "cpu", TorchAttentionBackend(), quantization="w8a8")
    # gguf quantizes the experts of a GGUF's stacked expert tensors (tests/models/test_gguf_families.py)
    with pytest.raises(ValueError, match=r"runs a \.gguf file's own tensors"):
        load_model(mixtral_dir, "float32", "cpu", TorchAttentionBackend(), quantization="gguf")


def test_tensor_parallel_shards_split_every_experts_intermediate_rows():
    from workers.model.tp import plan_shards, shard_checkpoint_tensor

    shards = plan_shards(4, 2, 128, 512, 2, moe_intermediate_size=32, shared_intermediate_size=48)
    assert [s.moe_intermediate for s in shards] == [(0, 16), (16, 16)]
    assert [s.shared_intermediate for s in shards] == [(0, 24), (24, 24)]
    w = torch.arange(32 * 8, dtype=torch.float32).reshape(32, 8)
    expert = shard_checkpoint_tensor(shards[1], 16, "model.layers.0.mlp.experts.3.gate_up_proj.weight", "up", w)
    assert torch.equal(expert, w[16:32])
    down = torch.zeros(8, 48)
    assert shard_checkpoint_tensor(shards[1], 16, "model.layers.0.mlp.shared_expert.down_proj.weight", "",
                                   down).shape == (8, 24)


def test_the_benchmarks_dense_loop_computes_the_same_layer(mixtral_dir):
    from cluster.bench.moe import dense_forward

    model, _ = load_model(mixtral_dir, "float32", "cpu", TorchAttentionBackend())
    moe = _moe(model)
    x = torch.randn(6, model.arch.hidden_size, generator=torch.Generator().manual_seed(1))
    routed, dense = moe(x), dense_forward(moe, x)
    assert torch.allclose(routed, dense, atol=1e-5, rtol=1e-5)  # every expert, weighed 0 where not chosen
