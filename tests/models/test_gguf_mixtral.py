"""Mixtral GGUFs (``llama`` files with a router and stacked experts): a
random-init ``MixtralForCausalLM`` of transformers' own class (8 experts,
top-2) written as GGUF with the ``gguf`` package the way llama.cpp's
converter writes one (``cluster/bench/moe_gguf.py``: Q / K rows permuted,
``ffn_{gate,up,down}_exps`` stacked ``[experts, rows, cols]``).

transformers' GGUF loader drops Mixtral's experts, so the oracle is the
model itself: the converted folder loads in transformers as the very same
weights, and our engine's greedy tokens are transformers'. Then
``quantization="gguf"`` runs the file's own blocks (experts in Q5_0 and
Q8_0, each expert its slice of the stacked tensor) and gives the float
path's greedy tokens on the dequantized weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.bench import moe_gguf
from tests.models.gguf_families_factory import _add_vocabulary, bpe_vocabulary
from workers.model.loader import convert_gguf_cached

NUM_EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, LAYERS = 8, 2, 128, 256, 4, 2, 2
PROMPTS = ["hello world", "the world is", "an answer in the", "hello hello hello the world and the"]
NUM_TOKENS = 8


def mixtral_model():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=len(bpe_vocabulary()[0]), hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                           num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                           num_local_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=1024,
                           rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False)
    model = MixtralForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a wrong norm mapping shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


def write_mixtral_gguf(model, path: Path, quantized: bool) -> Path:
    """``model`` as llama.cpp writes a Mixtral GGUF (``cluster/bench/moe_gguf.py``): F32 tensors, or Q5_0
    gate / up experts and Q8_0 other matrices (F32 norms and router), with the tiny BPE vocabulary."""
    kinds = ("Q5_0", "Q8_0") if quantized else ("F32", "F32")
    return moe_gguf.write_mixtral_gguf(model, path, lambda writer: _add_vocabulary(writer, "mixtral"), *kinds)


@pytest.fixture(scope="module")
def hf_model():
    return mixtral_model()


@pytest.fixture(scope="module")
def converted(hf_model, tmp_path_factory):
    path = write_mixtral_gguf(hf_model, tmp_path_factory.mktemp("gguf") / "tiny-mixtral.gguf", quantized=False)
    return convert_gguf_cached(path, tmp_path_factory.mktemp("cache"))


def test_the_folder_is_the_same_mixtral_for_transformers(hf_model, converted) -> None:
    from transformers import AutoModelForCausalLM

    from workers.model.loader import read_arch

    arch = read_arch(converted)
    assert (arch.family, arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == \
        ("mixtral", NUM_EXPERTS, TOP_K, INTERMEDIATE)
    reloaded = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    assert type(reloaded).__name__ == "MixtralForCausalLM"
    expected, got = hf_model.state_dict(), reloaded.state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


@torch.inference_mode()
def test_our_greedy_tokens_equal_transformers(hf_model, converted) -> None:
    from cluster.shared.types import SamplingParams
    from workers.llm import LLM

    with LLM(str(converted), dtype="float32") as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ids, tokens = list(out.prompt_token_ids), list(out.token_ids)
        logits = hf_model(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1:]
        assert logits.argmax(-1).tolist() == tokens, prompt
    assert len({t for out in outs for t in out.token_ids}) > 4  # not one token repeated


def test_gguf_quantization_runs_each_experts_blocks(hf_model, tmp_path) -> None:
    from cluster.shared.types import SamplingParams
    from workers.llm import LLM
    from workers.model import qgemm
    from workers.model.attention.torch_backend import TorchAttentionBackend
    from workers.model.linear import Linear
    from workers.model.loader import load_model

    if qgemm.load() is None:
        pytest.skip("no native quantized kernel here")
    path = write_mixtral_gguf(hf_model, tmp_path / "tiny-mixtral-q.gguf", quantized=True)
    folder = convert_gguf_cached(path, tmp_path / "cache")
    float_model, _ = load_model(folder, "float32", "cpu", TorchAttentionBackend())
    model, _ = load_model(folder, "float32", "cpu", TorchAttentionBackend(), quantization="gguf", gguf_path=path)
    floats = {n: m for n, m in float_model.named_modules() if isinstance(m, Linear)}
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    quantized = {n: m for n, m in linears.items() if m.quant is not None}
    assert set(quantized) == {n for n, m in linears.items() if not getattr(m, "keep_float", False)}
    assert len(quantized) == LAYERS * (2 + NUM_EXPERTS * 2) + 1
    assert {quantized[f"model.layers.1.mlp.experts.{e}.gate_up_proj"].quant.name for e in range(NUM_EXPERTS)} == \
        {"q5_0"}
    for name, layer in quantized.items():  # Q / K un-permuted, each expert its own slice
        ids = torch.arange(layer.out_features)
        reference = floats[name].packed.rows(ids) if floats[name].packed is not None else floats[name].weight
        assert torch.equal(layer.quant.dequantized_rows(ids), reference.detach()), name

    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(str(folder), dtype="float32") as llm:
        reference_tokens = [o.token_ids for o in llm.generate(PROMPTS, params)]
    with LLM(str(path), quantization="gguf") as llm:
        assert llm.runner.model.quantization == "gguf:q5_0+q8_0"
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == reference_tokens


def test_the_bench_writer_copies_another_files_tokenizer(hf_model, tmp_path) -> None:
    """``bench moe --write-gguf`` takes the default model's vocabulary this way (``moe_gguf.copy_tokenizer``)."""
    from gguf import GGUFReader

    src = write_mixtral_gguf(hf_model, tmp_path / "src.gguf", quantized=False)
    dst = moe_gguf.write_mixtral_gguf(hf_model, tmp_path / "dst.gguf", moe_gguf.copy_tokenizer(src), "F32", "F32")

    def tokenizer_fields(path):
        return {k: f.contents() for k, f in GGUFReader(str(path)).fields.items() if k.startswith("tokenizer.")}

    assert tokenizer_fields(dst) == tokenizer_fields(src) and len(tokenizer_fields(src)) >= 6
