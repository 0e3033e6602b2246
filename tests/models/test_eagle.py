"""EAGLE-1 drafts: a checkpoint written by hand in vLLM's published layout
loads and computes what Hugging Face's Llama decoder layer computes; shape
and vocabulary errors are named; in the engine, every proposal equals the one
the draft makes from scratch over the whole sequence (so its paged KV is
caught up right through chunked prefill, batching and verified steps); tokens
never change with it on (greedy and seeded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from cluster.shared.types import SamplingParams
from tests.factories import TINY, make_tiny_model_dir
from tests.unit.engine_fakes import assert_all_blocks_free_or_cached
from workers.llm import LLM
from workers.model.eagle import EagleDraft
from workers.model.loader import read_arch

H, V = TINY["hidden_size"], TINY["vocab_size"]


def write_vllm_eagle(folder: Path, seed: int = 0, hidden: int = H, vocab: int = V, fc_bias: bool = False,
                     scale: float = 0.2) -> Path:
    """A random EAGLE-1 checkpoint written from the published layout (as
    yuhuili/EAGLE-* and vLLM's EagleLlamaForCausalLM name it), not by our
    own ``save``: a LlamaConfig of one layer, ``fc`` over [embed; hidden],
    layer 0 without an input norm, the embedding stored but shared."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, inter = TINY["num_attention_heads"], TINY["num_key_value_heads"], TINY["intermediate_size"]
    d = hidden // heads

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    tensors = {"fc.weight": rand(hidden, 2 * hidden), "embed_tokens.weight": rand(vocab, hidden),
               "layers.0.self_attn.q_proj.weight": rand(heads * d, hidden),
               "layers.0.self_attn.k_proj.weight": rand(kv_heads * d, hidden),
               "layers.0.self_attn.v_proj.weight": rand(kv_heads * d, hidden),
               "layers.0.self_attn.o_proj.weight": rand(hidden, heads * d),
               "layers.0.post_attention_layernorm.weight": 1 + rand(hidden),
               "layers.0.mlp.gate_proj.weight": rand(inter, hidden),
               "layers.0.mlp.up_proj.weight": rand(inter, hidden),
               "layers.0.mlp.down_proj.weight": rand(hidden, inter)}
    if fc_bias:
        tensors["fc.bias"] = rand(hidden)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "num_hidden_layers": 1, "rms_norm_eps": TINY["rms_norm_eps"], "rope_theta": 10000.0,
              "max_position_embeddings": TINY["max_position_embeddings"], "vocab_size": vocab, "bias": fc_bias,
              "hidden_act": "silu", "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("tiny-eagle"))


def draft_features(draft: EagleDraft, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The draft over a whole sequence of rows at positions 0..n-1, causal."""
    n = len(hidden)
    x, q, k, v = draft.qkv(embeds, hidden, torch.arange(n))
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None]
    return draft.finish(x, draft.attend(q[None], k[None], v[None], mask)[0])


@pytest.mark.parametrize("fc_bias", [False, True])
def test_published_layout_computes_what_hf_llama_layer_computes(tmp_path, tiny_dir, fc_bias):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    folder = write_vllm_eagle(tmp_path / "eagle", fc_bias=fc_bias)
    draft = EagleDraft.load(folder, read_arch(tiny_dir))
    config = LlamaConfig(**json.loads((folder / "config.json").read_text()))
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, layer_idx=0).eval()
    from safetensors.torch import load_file

    weights = load_file(str(folder / "model.safetensors"))
    layer.load_state_dict({k.removeprefix("layers.0."): w for k, w in weights.items() if k.startswith("layers.0.")},
                          strict=False)
    layer.input_layernorm = torch.nn.Identity()  # vLLM's layer 0
    torch.manual_seed(1)
    tokens, hidden = torch.randint(0, V, (9,)), torch.randn(9, H)
    embeds = torch.randn(V, H)[tokens]
    x = F.linear(torch.cat([embeds, hidden], dim=-1), weights["fc.weight"], weights.get("fc.bias"))
    positions = torch.arange(9)[None]
    cos_sin = LlamaRotaryEmbedding(config)(x[None], positions)
    with torch.no_grad():
        expected = layer(x[None], position_ids=positions, position_embeddings=cos_sin)[0]
        got = draft_features(draft, embeds, hidden)
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()


def test_checkpoints_that_do_not_fit_the_target_are_refused(tmp_path, tiny_dir):
    arch = read_arch(tiny_dir)
    with pytest.raises(ValueError, match="hidden_size 32, the target 64"):
        EagleDraft.load(write_vllm_eagle(tmp_path / "narrow", hidden=32), arch)
    with pytest.raises(ValueError, match="vocab_size 600, the target 512"):
        EagleDraft.load(write_vllm_eagle(tmp_path / "wide", vocab=600), arch)
    folder = write_vllm_eagle(tmp_path / "bad_fc")
    from safetensors.torch import load_file

    weights = load_file(str(folder / "model.safetensors"))
    weights["fc.weight"] = weights["fc.weight"][:, :H].contiguous()  # Medusa-like: no embedding half
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"fc.weight is \(64, 64\), expected \(64, 128\)"):
        EagleDraft.load(folder, arch)
    with pytest.raises(ValueError, match="not an EAGLE checkpoint"):
        LLM(str(tiny_dir), speculative_config={"method": "eagle", "model": str(tmp_path / "nothing")})


def reference_proposal(draft, embed, lm_head, hidden: torch.Tensor, tokens: list[int], k: int) -> list[int]:
    """d1..dk from scratch: rows (h_i, t_{i+1}) for i < n - 1, then each
    guess appended with the feature that made it, the whole sequence rerun."""
    feats = hidden[: len(tokens) - 1]
    nexts = list(tokens[1:])
    out: list[int] = []
    for _ in range(k):
        f = draft_features(draft, embed(torch.tensor(nexts)), feats)
        out.append(int(lm_head(f[-1:]).argmax(dim=-1)))
        feats = torch.cat([feats, f[-1:]])
        nexts.append(out[-1])
    return out


def test_every_proposal_equals_the_draft_run_from_scratch(tmp_path, tiny_dir):
    from transformers import AutoModelForCausalLM

    folder = write_vllm_eagle(tmp_path / "eagle", seed=3)
    config = {"method": "eagle", "model": str(folder), "num_speculative_tokens": 3, "adaptive": False}
    # Chunked prefill (8 tokens a step), several sequences batched, arriving at different steps.
    llm = LLM(str(tiny_dir), block_size=4, max_num_batched_tokens=8, max_num_seqs=4, enable_prefix_caching=False,
              speculative_config=config)
    engine = llm.engine
    seen: list[tuple[str, int, list[int]]] = []
    proposer = engine.scheduler.speculator.proposer
    receive = proposer.receive
    proposer.receive = lambda rid, n, cands: (seen.append((rid, n, cands[0])), receive(rid, n, cands))[1]
    prompts = [[5 + i, 17, 33, 9 + i, 61, 12, 40, 8, 90 + i, 3, 44, 7][: 5 + 3 * i] for i in range(3)]
    reqs = [llm.make_request(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)) for p in prompts]
    tokens = {r.request_id: list(p) for r, p in zip(reqs, prompts)}
    engine.add_request(reqs[0])
    pending = reqs[1:]
    while engine.has_unfinished_requests() or pending:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if pending:
            engine.add_request(pending.pop(0))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), torch_dtype=torch.float32).eval()
    draft = EagleDraft.load(folder, read_arch(tiny_dir))
    embed, lm_head = hf.get_input_embeddings(), hf.get_output_embeddings()
    assert len(seen) >= 12
    with torch.no_grad():
        for rid, n, guess in seen:
            full = tokens[rid][:n]
            hidden = hf(torch.tensor([full]), output_hidden_states=True).hidden_states[-1][0]
            assert guess == reference_proposal(draft, embed, lm_head, hidden, full, len(guess)), (rid, n)
    assert engine.scheduler.speculator.stats.num_draft_tokens > 0


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_tokens_never_change_with_eagle(tmp_path, tiny_dir, sampling):
    folder = write_vllm_eagle(tmp_path / "eagle", seed=1)
    config = {"method": "eagle", "model": str(folder), "num_speculative_tokens": 3, "adaptive": False}
    prompts = [[10 + i, 20, 30 + i, 40, 10 + i, 20, 30 + i, 40, 10 + i, 20] for i in range(4)] + [[7, 99, 3, 250]]
    if sampling == "greedy":
        params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)] * 5
    else:
        params = [SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=i, logprobs=1, ignore_eos=True)
                  for i in range(5)]
    plain = LLM(str(tiny_dir), block_size=4).generate(prompts, params)
    spec = LLM(str(tiny_dir), block_size=4, num_kv_blocks=40, preemption_mode="swap", speculative_config=config)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    stats = spec.engine.scheduler.speculator.stats
    assert stats.num_drafts >= 10 and stats.num_draft_tokens > 0
    assert_all_blocks_free_or_cached(spec.engine.scheduler)


def test_train_eagle_on_a_tiny_model_writes_the_layout_it_loads(tiny_dir, tmp_path):
    from workers.eagle_train import train_eagle

    llm = LLM(str(tiny_dir), block_size=4, max_model_len=256)
    summary = train_eagle(llm, tmp_path / "eagle", num_prompts=12, prompt_len=16, gen_len=24, lr=3e-3,
                          batch_size=4, shortlist=200, min_steps=12)
    assert summary["num_sequences"] == 12 and summary["num_positions"] >= 12 * 20
    # No epochs given: as many passes over the 11 training sequences (3 batches) as make 12 steps.
    assert summary["epochs"] == 4 and summary["optimizer_steps"] == 12
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and len(config["vocab_shortlist"]) == 200
    from safetensors import safe_open

    with safe_open(str(tmp_path / "eagle" / "model.safetensors"), framework="pt") as f:
        assert {"fc.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"} <= set(f.keys())
        assert float(f.get_tensor("layers.0.mlp.down_proj.weight").abs().sum()) > 0  # trained from its zero start
    spec = LLM(str(tiny_dir), block_size=4,
               speculative_config={"method": "eagle", "model": str(tmp_path / "eagle"), "adaptive": False})
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[10, 20, 30, 40, 10, 20], [7, 99, 3, 250, 41]]
    assert [o.token_ids for o in spec.generate(prompts, params)] == [
        o.token_ids for o in llm.generate(prompts, params)]
    assert spec.engine.scheduler.speculator.stats.num_accepted_tokens > 0  # the trained draft guesses some


def test_bench_spec_measures_eagle_medusa_and_ngram_side_by_side(tiny_dir, tmp_path, capsys):
    import argparse

    from cluster.bench.spec import run_spec
    from workers.model.medusa import MedusaHeads

    MedusaHeads(H, V, num_heads=3, num_layers=1).save(tmp_path / "heads")
    eagle = write_vllm_eagle(tmp_path / "eagle", seed=2)
    args = argparse.Namespace(batch_sizes=[1, 2], workloads=["random"], input_len=12, output_len=6, fixed=False,
                              chain=False, rounds=1, json=str(tmp_path / "spec.json"),
                              also=[json.dumps({"method": "medusa", "model": str(tmp_path / "heads"),
                                                "adaptive": False}),
                                    '{"method": "ngram", "num_speculative_tokens": 3, "adaptive": false}'])
    engine = {"model": str(tiny_dir), "block_size": 4,
              "speculative_config": {"method": "eagle", "model": str(eagle), "adaptive": False}}
    assert run_spec(args, engine) == 0
    report = json.loads((tmp_path / "spec.json").read_text())
    assert [c["method"] for c in report["also"]] == ["medusa", "ngram"]
    for case in report["cases"]:
        for mode in ("eagle-fixed", "medusa-fixed", "ngram-fixed"):
            assert case[mode]["identical_to_off"], (mode, case)
        assert case["eagle-fixed"]["draft_tokens"] > 0 and case["medusa-fixed"]["draft_tokens"] > 0
        # Chains of up to 4 (eagle's default; shorter only near max_tokens): a position is drafted only
        # after the ones before it, and counted per position.
        proposed = case["eagle-fixed"]["proposed_per_position"]
        assert len(proposed) == 4 and proposed[0] > 0 and proposed == sorted(proposed, reverse=True)
        assert len(case["eagle-fixed"]["acceptance_per_position"]) == 4
        assert len(case["off"]["decode_tokens_per_s_by_round"]) == 1  # one round: its figure
    header = capsys.readouterr().out.splitlines()[0]
    assert "eagle-fixed tok/s" in header and "medusa-fixed tok/s" in header and "ngram-fixed tok/s" in header
