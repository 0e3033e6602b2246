"""ModelArchConfig parsing: both HF config formats, defaults, per-layer windows, clear errors."""

from __future__ import annotations

import math

import pytest

from tests.factories import make_hf_config
from tests.models.conftest import LLAMA3_ROPE
from workers.model.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    Llama3RopeScaling,
    ModelArchConfig,
)
from workers.model.longrope import LongRopeScaling


def _parse(family: str, **overrides) -> ModelArchConfig:
    return ModelArchConfig.from_hf_config(make_hf_config(family, **overrides).to_dict())


def _llama_v4_dict(**overrides) -> dict:
    """A transformers-v4 style Llama config.json (rope_theta + rope_scaling at top level)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 4096,
    }
    config.update(overrides)
    return config


def test_llama_sizes_and_defaults() -> None:
    arch = ModelArchConfig.from_hf_config(_llama_v4_dict())
    assert arch.family == "llama"
    assert arch.num_key_value_heads == 8  # absent: MHA
    assert arch.head_dim == 8  # absent: hidden / heads
    assert arch.rope_theta == 500000.0 and arch.rope_scaling is None
    assert arch.sliding_window is None and arch.layer_types == (FULL_ATTENTION,) * 2
    assert not arch.attention_bias and not arch.o_proj_bias and not arch.tie_word_embeddings
    assert arch.eos_token_ids == () and arch.eos_token_id is None


def test_eos_list_and_bos() -> None:
    arch = ModelArchConfig.from_hf_config(_llama_v4_dict(bos_token_id=5, eos_token_id=[7, 9]))
    assert arch.bos_token_id == 5
    assert arch.eos_token_ids == (7, 9) and arch.eos_token_id == 7


def test_llama3_rope_scaling_both_formats() -> None:
    expected = Llama3RopeScaling(8.0, 1.0, 4.0, 32)
    v5 = _parse("llama", rope_parameters=LLAMA3_ROPE)
    assert v5.rope_scaling == expected and v5.rope_theta == 10000.0
    legacy_scaling = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    v4 = ModelArchConfig.from_hf_config(_llama_v4_dict(rope_scaling=legacy_scaling))  # rope_theta 5e5 on top
    assert v4.rope_scaling == expected and v4.rope_theta == 500000.0


def test_llama3_original_context_defaults_to_max_positions() -> None:
    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    arch = ModelArchConfig.from_hf_config(_llama_v4_dict(rope_scaling=scaling))
    assert arch.rope_scaling.original_max_position_embeddings == 4096


@pytest.mark.parametrize("rope_type", ["yarn", "linear", "dynamic"])
def test_unsupported_rope_type_is_rejected(rope_type: str) -> None:
    with pytest.raises(ValueError, match=f"rope type '{rope_type}' is not supported; supported: default, llama3, longrope"):
        ModelArchConfig.from_hf_config(_llama_v4_dict(rope_scaling={"rope_type": rope_type, "factor": 2.0}))


def test_phi3_reads_as_a_llama_layout() -> None:
    arch = _parse("phi3")
    assert arch.family == "phi3" and not arch.attention_bias and not arch.qk_norm and arch.rope_scaling is None


def test_phi3_longrope_as_transformers_reads_it() -> None:
    """Both factor lists, the original length and the attention factor transformers
    computes (from max / original when the config gives none)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = make_hf_config("phi3_longrope")
    scaling = ModelArchConfig.from_hf_config(hf.to_dict()).rope_scaling
    assert isinstance(scaling, LongRopeScaling) and scaling.original_max_position_embeddings == 20
    assert scaling.short_factor == tuple(1.0 + 0.1 * i for i in range(8)) and scaling.long_factor[1] == 1.9
    assert scaling.attention_factor == ROPE_INIT_FUNCTIONS["longrope"](hf)[1]
    # A transformers-v4 Phi-3.5 config.json: legacy type "su", the original length at the top.
    v4 = _llama_v4_dict(architectures=["Phi3ForCausalLM"], max_position_embeddings=131072,
                        original_max_position_embeddings=4096,
                        rope_scaling={"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4})
    scaling = ModelArchConfig.from_hf_config(v4).rope_scaling
    assert scaling.original_max_position_embeddings == 4096 and scaling.long_factor == (2.0,) * 4
    assert scaling.attention_factor == math.sqrt(1 + math.log(32) / math.log(4096))
    v4["rope_scaling"]["attention_factor"] = 1.25
    assert ModelArchConfig.from_hf_config(v4).rope_scaling.attention_factor == 1.25
    v4["rope_scaling"]["short_factor"] = [1.0] * 3
    with pytest.raises(ValueError, match="'short_factor': a list of head_dim / 2 = 4 numbers"):
        ModelArchConfig.from_hf_config(v4)


def test_gemma3_local_and_global_layers_and_its_constants() -> None:
    arch = _parse("gemma3")
    assert arch.family == "gemma3" and arch.sandwich_norms and arch.qk_norm and arch.hidden_act == "gelu_pytorch_tanh"
    assert arch.rope_theta == 1e6 and arch.local_rope_theta == 1e4 and arch.query_pre_attn_scalar == 24
    assert arch.embed_scale == 64 ** 0.5 and [arch.layer_sliding_window(i) for i in range(2)] == [8, None]
    v4 = make_hf_config("gemma3").to_dict()  # the transformers v4 layout of the same RoPE bases
    del v4["rope_parameters"]
    v4.update(rope_theta=1e6, rope_local_base_freq=1e4)
    assert ModelArchConfig.from_hf_config(v4).local_rope_theta == 1e4
    assert arch.attn_logit_softcapping is None and arch.final_logit_softcapping is None
    with pytest.raises(ValueError, match="soft-capping is supported for Gemma 2 only, not in a Gemma 3 config"):
        _parse("gemma3", final_logit_softcapping=30.0)


def test_gemma2_soft_caps_one_rope_base_and_alternating_layers() -> None:
    arch = _parse("gemma2")
    assert arch.family == "gemma2" and arch.sandwich_norms and not arch.qk_norm
    assert arch.attn_logit_softcapping == 5.0 and arch.final_logit_softcapping == 3.0
    assert arch.rope_theta == 1e4 and arch.local_rope_theta is None and arch.query_pre_attn_scalar == 24
    assert arch.embed_scale == 64 ** 0.5 and arch.hidden_act == "gelu_pytorch_tanh"
    # A Gemma 2 config.json of transformers v4 (the released checkpoints): no layer_types, even layers local.
    v4 = {k: v for k, v in make_hf_config("gemma2", num_hidden_layers=4).to_dict().items()
          if k not in ("layer_types", "rope_parameters")}
    v4.update(rope_theta=10000.0, attention_bias=True)
    old = ModelArchConfig.from_hf_config(v4)
    assert [old.layer_sliding_window(i) for i in range(4)] == [8, None, 8, None]
    assert old.attention_bias and old.o_proj_bias  # transformers' Gemma 2 biases o_proj too
    with pytest.raises(ValueError, match="attn_logit_softcapping must be > 0"):
        _parse("gemma2", attn_logit_softcapping=0.0)
    with pytest.raises(ValueError, match="use_bidirectional_attention is not supported"):
        _parse("gemma2", use_bidirectional_attention=True)


def test_unsupported_architecture_names_supported_ones() -> None:
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM, MistralForCausalLM, Qwen2"):
        ModelArchConfig.from_hf_config(_llama_v4_dict(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="names no 'architectures'"):
        ModelArchConfig.from_hf_config(_llama_v4_dict(architectures=[]))


def test_model_type_stands_in_for_missing_architectures() -> None:
    arch = ModelArchConfig.from_hf_config(_llama_v4_dict(architectures=None, model_type="mistral"))
    assert arch.family == "mistral"


def test_mistral_sliding_window_on_every_layer() -> None:
    arch = _parse("mistral", sliding_window=8)
    assert arch.family == "mistral" and arch.sliding_window == 8
    assert [arch.layer_sliding_window(i) for i in range(2)] == [8, 8]


def test_qwen2_bias_and_optional_window() -> None:
    plain = _parse("qwen2", sliding_window=8)  # use_sliding_window defaults to False
    assert plain.attention_bias and not plain.o_proj_bias
    assert plain.sliding_window is None and set(plain.layer_types) == {FULL_ATTENTION}
    upper = _parse("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1, num_hidden_layers=3)
    assert upper.layer_types == (FULL_ATTENTION, SLIDING_ATTENTION, SLIDING_ATTENTION)
    assert [upper.layer_sliding_window(i) for i in range(3)] == [None, 8, 8]


def test_qwen3_norms_its_query_and_key_heads() -> None:
    arch = _parse("qwen3", head_dim=24, attention_bias=True)
    assert arch.family == "qwen3" and arch.qk_norm and arch.head_dim == 24
    assert arch.attention_bias and arch.o_proj_bias  # Qwen3's attention_bias covers o_proj too
    assert not _parse("qwen2").qk_norm and not _parse("llama").qk_norm
    upper = _parse("qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=1, num_hidden_layers=3)
    assert [upper.layer_sliding_window(i) for i in range(3)] == [None, 8, 8]


def test_qwen2_window_without_layer_types_uses_max_window_layers() -> None:
    config = make_hf_config("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1).to_dict()
    del config["layer_types"]
    arch = ModelArchConfig.from_hf_config(config)
    assert arch.layer_types == (FULL_ATTENTION, SLIDING_ATTENTION)


def test_llama_attention_bias_covers_o_proj() -> None:
    arch = _parse("llama", attention_bias=True)
    assert arch.attention_bias and arch.o_proj_bias


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_key_value_heads": 3}, "must be a multiple of num_key_value_heads"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_invalid_configs_are_rejected(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelArchConfig.from_hf_config(_llama_v4_dict(**overrides))


def test_config_is_frozen() -> None:
    arch = ModelArchConfig.from_hf_config(_llama_v4_dict())
    with pytest.raises(AttributeError):
        arch.vocab_size = 5  # type: ignore[misc]
