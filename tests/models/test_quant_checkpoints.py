"""GPTQ and AWQ checkpoints (``quant/checkpoints.py``): the packed layouts read
back what was packed, act order (a permuted ``g_idx``) computes the same
product, ``prefixserve quantize`` writes folders that load as quantized models
computing what their dequantized float weights compute, and a checkpoint that
does not match its config fails at load naming the tensor."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cluster.shared.types import SamplingParams
from tests.factories import make_tiny_model_dir
from workers.llm import LLM
from workers.model import qgemm
from workers.model.quant import checkpoint_writer, checkpoints
from workers.model.quant.checkpoints import QuantSpec, decode_layer
from workers.model.quant.checkpoint_writer import pack_layer
from workers.model.quant.methods import PermutedInputs, quantize_int4

pytestmark = pytest.mark.skipif(qgemm.load() is None, reason="no native quantized kernel here")


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("group", [32, 128])
def test_packed_layers_read_back_their_values(method, group):
    w = torch.randn(48, 256).numpy()
    decoded = quantize_int4(w, group)
    packed = pack_layer(decoded, method)
    assert packed["qweight"].dtype == torch.int32 and packed["scales"].dtype == torch.float16
    assert packed["qweight"].shape == ((256 // 8, 48) if method == "gptq" else (256, 48 // 8))
    back = decode_layer("layer", packed, QuantSpec(method, 4, group)).decoded
    assert np.array_equal(back.q, decoded.q)
    scales16 = decoded.scales.astype(np.float16).astype(np.float32)
    assert np.array_equal(back.scales, scales16)
    zeros = np.clip(np.rint(-decoded.mins / decoded.scales), 0, 15)
    assert np.array_equal(back.mins, -scales16 * zeros.astype(np.float32))


def test_gptq_act_order_permutes_inputs_into_groups():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 64)).astype(np.float32)
    perm = rng.permutation(64)  # input perm[i] is the i-th in group order
    grouped = quantize_int4(w[:, perm], 32)
    packed = pack_layer(grouped, "gptq")
    # Back to checkpoint order: rows of qweight follow the inputs, g_idx names each input's group.
    inverse = np.argsort(perm)
    q = grouped.q.T[inverse]  # [K, N] in input order
    packed["qweight"] = torch.from_numpy(checkpoint_writer._pack_nibbles(q, 0))
    packed["g_idx"] = torch.from_numpy((inverse // 32).astype(np.int32))
    layer = decode_layer("layer", packed, QuantSpec("gptq", 4, 32, desc_act=True))
    assert layer.perm is not None
    weight = PermutedInputs(qgemm.QuantWeight(layer.decoded.q, layer.decoded.scales, layer.decoded.mins, 4, 32,
                                              None, qgemm.load()), layer.perm)
    dense = checkpoints.float_weight(layer)  # [N, K] in input order
    x = torch.randn(5, 64)
    torch.testing.assert_close(weight.matmul(x), x @ dense.T, atol=1e-5, rtol=1e-5)
    assert torch.equal(weight.dequantized_rows(torch.tensor([0, 39])), dense[[0, 39]])


def dequantized_folder(src, dst):
    """The checkpoint with every quantized layer written back as its float weight (a plain folder)."""
    from safetensors.torch import save_file

    from workers.model.loader import iter_weights

    spec = QuantSpec.from_config(src)
    layers: dict = {}
    tensors = dict(checkpoints.read_checkpoint(iter_weights(src), spec, layers))
    dst.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config))
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    return dst


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_quantize_writes_a_checkpoint_that_loads_and_computes_its_weights(tmp_path, method):
    from cluster.cli.main import main

    tiny = make_tiny_model_dir("qwen2", tmp_path / "tiny")  # q/k/v bias too
    out = tmp_path / method
    assert main(["quantize", "--model", str(tiny), "--method", method, "--group-size", "32",
                 "--output", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == method and config["group_size"] == 32
    quantized = LLM(str(out), block_size=4)  # found in config.json
    assert quantized.runner.quantization == f"{method}-g32"
    plain = LLM(str(dequantized_folder(out, tmp_path / "float")), block_size=4)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    prompts = [list(range(3, 30)), list(range(40, 52))]
    for a, b in zip(quantized.generate(prompts, params), plain.generate(prompts, params)):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    with pytest.raises(ValueError, match="quantization must be 'gptq' or None" if method == "gptq" else "'awq' or None"):
        LLM(str(out), quantization="int8")


def test_checkpoints_that_do_not_match_fail_naming_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    from cluster.cli.main import main

    tiny = make_tiny_model_dir("llama", tmp_path / "tiny")
    out = tmp_path / "gptq"
    assert main(["quantize", "--model", str(tiny), "--method", "gptq", "--group-size", "32",
                 "--output", str(out)]) == 0
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["group_size"] = 64  # the tensors hold groups of 32
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model.layers.0.\S+.scales has shape .* check "
                                         r"quantization_config.group_size"):
        LLM(str(out))
    config["quantization_config"]["group_size"] = 32
    config_path.write_text(json.dumps(config))
    tensors = load_file(str(out / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.qzeros"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks model.layers.1.mlp.down_proj.qzeros"):
        LLM(str(out))
    with pytest.raises(ValueError, match="has no such quantization_config"):
        LLM(str(tiny), quantization="gptq")


def test_gptq_checkpoint_evaluated_against_its_float_model(tmp_path, caplog):
    # `eval perplexity` names the checkpoint's quantization, and its greedy
    # agreement needs the float model: without --reference-model it says so.
    from safetensors.torch import load_file

    from cluster.cli.main import main

    tiny = make_tiny_model_dir("llama", tmp_path / "tiny")
    out = tmp_path / "gptq"
    assert main(["quantize", "--model", str(tiny), "--method", "gptq", "--group-size", "32",
                 "--calibration-tokens", "256", "--output", str(out)]) == 0
    rounded = tmp_path / "int4"  # --method int4: the same layout, rounded to nearest
    assert main(["quantize", "--model", str(tiny), "--method", "int4", "--group-size", "32",
                 "--output", str(rounded)]) == 0
    assert json.loads((rounded / "config.json").read_text())["quantization_config"]["quant_method"] == "gptq"
    assert not torch.equal(load_file(str(rounded / "model.safetensors"))["model.layers.0.mlp.down_proj.qweight"],
                           load_file(str(out / "model.safetensors"))["model.layers.0.mlp.down_proj.qweight"])
    report = tmp_path / "ppl.json"
    assert main(["eval", "perplexity", "--model", str(out), "--agreement", "--max-tokens", "64", "--window", "32",
                 "--json", str(report)]) != 0
    assert "pass --reference-model" in caplog.text and not report.exists()
    assert main(["eval", "perplexity", "--model", str(out), "--agreement", "--reference-model", str(tiny),
                 "--max-tokens", "64", "--window", "32", "--num-prompts", "2", "--agree-tokens", "4",
                 "--json", str(report)]) == 0
    result = json.loads(report.read_text())
    assert result["quantization"] == "gptq-g32" and result["perplexity"] > 1
    assert "agreement" in result


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_w8a8_checkpoint_runs_what_w8a8_computes_at_load(tmp_path, family):
    # `quantize --method w8a8` writes the int8 weights and smoothed norms that
    # quantization="w8a8" computes at load, in compressed-tensors' format: the
    # checkpoint loads as w8a8 with no calibration and gives the same logprobs.
    from safetensors.torch import load_file

    from cluster.cli.main import main
    from workers.model import i8gemm

    if i8gemm.load() is None:
        pytest.skip("no native int8 kernel here")
    tiny = make_tiny_model_dir(family, tmp_path / "tiny")
    out = tmp_path / "w8a8"
    assert main(["quantize", "--model", str(tiny), "--method", "w8a8", "--output", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "int-quantized"
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["model.layers.0.self_attn.k_proj.weight"].dtype == torch.int8
    assert tensors["model.layers.0.self_attn.k_proj.weight_scale"].shape[1] == 1
    from_checkpoint = LLM(str(out), block_size=4)
    assert from_checkpoint.runner.quantization == "w8a8"
    at_load = LLM(str(tiny), block_size=4, quantization="w8a8")
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
    prompts = [list(range(3, 30)), list(range(40, 52))]
    for a, b in zip(from_checkpoint.generate(prompts, params), at_load.generate(prompts, params)):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == [y.logprob for y in b.logprobs]
    with pytest.raises(ValueError, match="quantization must be 'w8a8' or None"):
        LLM(str(out), quantization="int8")


def test_compressed_tensors_other_than_w8a8_int8_is_refused(tmp_path):
    tiny = make_tiny_model_dir("llama", tmp_path / "tiny", with_tokenizer=False)
    config = json.loads((tiny / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                     "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float"}}}}
    (tiny / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="W8A8 int8 only"):
        QuantSpec.from_config(tiny)
