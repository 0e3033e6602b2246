"""Mixtral GGUFs (``llama`` files with a router and stacked experts): a
random-init ``MixtralForCausalLM`` of transformers' own class (8 experts,
top-2) written as GGUF with the ``gguf`` package the way llama.cpp's
converter writes one (Q / K rows permuted, ``ffn_{gate,up,down}_exps``
stacked ``[experts, rows, cols]``).

transformers' GGUF loader drops Mixtral's experts, so the oracle is the
model itself: the converted folder loads in transformers as the very same
weights, and our engine's greedy tokens are transformers'. Then
``quantization="gguf"`` runs the file's own blocks (experts in Q5_0 and
Q8_0, each expert its slice of the stacked tensor) and gives the float
path's greedy tokens on the dequantized weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

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


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q / K row order (interleaved rotary pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_mixtral_gguf(model, path: Path, quantized: bool) -> Path:
    """``model`` as a llama-architecture GGUF: F32 tensors, or Q8_0 (attention, embedding, head, down
    experts) and Q5_0 (gate / up experts) with F32 norms and router."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFWriter
    from gguf.quants import quantize

    writer = GGUFWriter(str(path), "llama")
    for key, value in {"context_length": 1024, "embedding_length": HIDDEN, "block_count": LAYERS,
                       "feed_forward_length": INTERMEDIATE, "attention.head_count": HEADS,
                       "attention.head_count_kv": KV_HEADS, "rope.dimension_count": HIDDEN // HEADS,
                       "expert_count": NUM_EXPERTS, "expert_used_count": TOP_K}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_float32("llama.rope.freq_base", float(model.config.rope_parameters["rope_theta"]))
    _add_vocabulary(writer, "mixtral")
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}

    def add(name: str, w: np.ndarray, kind=Q.Q8_0) -> None:
        if quantized and w.ndim >= 2 and kind != Q.F32:
            writer.add_tensor(name, quantize(np.ascontiguousarray(w), kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))

    add("token_embd.weight", state["model.embed_tokens.weight"])
    add("output_norm.weight", state["model.norm.weight"])
    add("output.weight", state["lm_head.weight"])
    for i in range(LAYERS):
        hf, p = f"model.layers.{i}.", f"blk.{i}."
        add(p + "attn_q.weight", _permute(state[hf + "self_attn.q_proj.weight"], HEADS))
        add(p + "attn_k.weight", _permute(state[hf + "self_attn.k_proj.weight"], KV_HEADS))
        add(p + "attn_v.weight", state[hf + "self_attn.v_proj.weight"])
        add(p + "attn_output.weight", state[hf + "self_attn.o_proj.weight"])
        add(p + "attn_norm.weight", state[hf + "input_layernorm.weight"])
        add(p + "ffn_norm.weight", state[hf + "post_attention_layernorm.weight"])
        add(p + "ffn_gate_inp.weight", state[hf + "mlp.gate.weight"], Q.F32)
        gate, up = np.split(state[hf + "mlp.experts.gate_up_proj"], 2, axis=1)  # [E, 2 * I, H]
        add(p + "ffn_gate_exps.weight", gate, Q.Q5_0)
        add(p + "ffn_up_exps.weight", up, Q.Q5_0)
        add(p + "ffn_down_exps.weight", state[hf + "mlp.experts.down_proj"])  # [E, H, I]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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
