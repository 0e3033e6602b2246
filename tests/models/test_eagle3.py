"""EAGLE-3 drafts: a checkpoint written from vLLM's published layout loads
and computes what vLLM's ``Eagle3LlamaForCausalLM`` layer computes (written
out here from its forward, with transformers' rotary embedding); bad
checkpoints are refused with what is wrong; in the engine, every proposal
equals the draft run from scratch over the target's low / middle / high
layer inputs (Hugging Face's ``hidden_states``), through chunked prefill and
batching; tokens never change with it on, chains and EAGLE-2 trees."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from cluster.shared.types import SamplingParams
from tests.factories import TINY, make_tiny_model_dir
from tests.models.eagle3_factory import write_vllm_eagle3
from tests.models.test_eagle import write_vllm_eagle
from tests.unit.engine_fakes import assert_all_blocks_free_or_cached
from workers.llm import LLM
from workers.model.eagle3 import Eagle3Draft
from workers.model.loader import read_arch

H, V = TINY["hidden_size"], TINY["vocab_size"]
LAYERS = 8  # vLLM's default features for 8 layers: the inputs of layers 2, 4 and 5


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("tiny-eagle3"), num_hidden_layers=LAYERS)


def vllm_layer(weights: dict, config: dict, embeds: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's layer 0 and final norm over n rows at positions 0..n-1, causal:
    (normed output for the LM head, pre-norm output fed back)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    eps, w = config["rms_norm_eps"], (lambda name: weights[f"midlayer.{name}.weight"])

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    n, heads, kv_heads = len(g), config["num_attention_heads"], config["num_key_value_heads"]
    d = config["hidden_size"] // heads
    residual = g
    u = torch.cat([rms(embeds, w("input_layernorm")), rms(g, w("hidden_norm"))], dim=-1)
    q = F.linear(u, w("self_attn.q_proj")).view(1, n, heads, d).transpose(1, 2)
    k = F.linear(u, w("self_attn.k_proj")).view(1, n, kv_heads, d).transpose(1, 2)
    v = F.linear(u, w("self_attn.v_proj")).view(1, n, kv_heads, d).transpose(1, 2)
    cos, sin = LlamaRotaryEmbedding(LlamaConfig(**config))(u[None], torch.arange(n)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(n, heads * d)
    residual = residual + F.linear(attn, w("self_attn.o_proj"))
    h = rms(residual, w("post_attention_layernorm"))
    residual = residual + F.linear(F.silu(F.linear(h, w("mlp.gate_proj"))) * F.linear(h, w("mlp.up_proj")),
                                   w("mlp.down_proj"))
    return rms(residual, weights["norm.weight"]), residual


def draft_features(draft: Eagle3Draft, embeds: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Our draft over rows at positions 0..n-1, causal (``g``: H-wide inputs, fc already applied)."""
    n = len(g)
    x, q, k, v = draft.qkv(embeds, g, torch.arange(n))
    return draft.finish(x, draft.attend(q[None], k[None], v[None], torch.ones(n, n, dtype=torch.bool).tril()[None])[0])


def test_published_layout_computes_what_vllms_eagle3_layer_computes(tmp_path, tiny_dir):
    folder = write_vllm_eagle3(tmp_path / "e3", seed=2)
    draft = Eagle3Draft.load(folder, read_arch(tiny_dir))
    assert draft.aux_layer_ids == (2, 4, 5)
    weights, config = load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text())
    torch.manual_seed(1)
    aux, embeds = torch.randn(9, 3 * H), torch.randn(9, H)
    g = F.linear(aux, weights["fc.weight"])
    normed, prenorm = vllm_layer(weights, config, embeds, g)
    with torch.no_grad():
        x, q, k, v = draft.qkv(embeds, aux, torch.arange(9))  # the fused features go through fc
        causal = torch.ones(9, 9, dtype=torch.bool).tril()[None]
        got = draft.finish(x, draft.attend(q[None], k[None], v[None], causal)[0])
        assert torch.allclose(got, prenorm, atol=1e-5), (got - prenorm).abs().max()
        assert torch.allclose(draft_features(draft, embeds, g), prenorm, atol=1e-5)
        logits = draft.logits(got)
    assert torch.allclose(logits, F.linear(normed, weights["lm_head.weight"]), atol=1e-4)
    # d2t: draft id i is target id i + d2t[i] (every 4th target id here).
    assert draft.token_ids[:3].tolist() == [0, 4, 8] and int(weights["d2t"][1]) == 3


def test_checkpoints_that_do_not_fit_the_target_are_refused(tmp_path, tiny_dir):
    arch = read_arch(tiny_dir)
    with pytest.raises(ValueError, match="input_layernorm.weight is missing: not an EAGLE-3 checkpoint"):
        Eagle3Draft.load(write_vllm_eagle(tmp_path / "eagle1"), arch)
    with pytest.raises(ValueError, match="vocab_size 600, the target 512"):
        Eagle3Draft.load(write_vllm_eagle3(tmp_path / "wide", vocab=600), arch)
    with pytest.raises(ValueError, match="features of width 32 .target_hidden_size., the target's are 64"):
        Eagle3Draft.load(write_vllm_eagle3(tmp_path / "narrow", hidden=32), arch)
    with pytest.raises(ValueError, match=r"here \[2, 4, 9\], but the target has 8 layers"):
        Eagle3Draft.load(write_vllm_eagle3(tmp_path / "deep", layer_ids=[2, 4, 9]), arch)
    folder = write_vllm_eagle3(tmp_path / "bad_d2t")
    weights = load_file(str(folder / "model.safetensors"))
    weights["d2t"] = weights["d2t"] + V  # every draft id past the target's vocabulary
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t maps draft ids outside the target's vocabulary of 512 tokens"):
        Eagle3Draft.load(folder, arch)
    del weights["d2t"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="draft vocabulary of 128 tokens .the target has 512. needs d2t"):
        Eagle3Draft.load(folder, arch)
    two_layers = make_tiny_model_dir("llama", tmp_path / "two", with_tokenizer=False)
    with pytest.raises(ValueError, match=r"here \[2, 1, -1\], but the target has 2 layers"):
        LLM(str(two_layers), speculative_config={"method": "eagle3", "model": str(write_vllm_eagle3(tmp_path / "ok"))})
    with pytest.raises(ValueError, match="not an EAGLE-3 checkpoint: it has no config.json"):
        LLM(str(tiny_dir), speculative_config={"method": "eagle3", "model": str(tmp_path / "nothing")})


def reference_proposal(draft: Eagle3Draft, embed, aux: torch.Tensor, tokens: list[int], k: int) -> list[int]:
    """d1..dk from scratch: rows (fc(a_i), t_{i+1}) for i < n - 1, then each
    guess appended with the feature that made it, the whole sequence rerun."""
    g = draft.fc(aux[: len(tokens) - 1])
    nexts = list(tokens[1:])
    out: list[int] = []
    for _ in range(k):
        f = draft_features(draft, embed(torch.tensor(nexts)), g)
        out.append(int(draft.token_ids[draft.logits(f[-1:]).argmax(dim=-1)]))
        g = torch.cat([g, f[-1:]])
        nexts.append(out[-1])
    return out


@pytest.mark.parametrize("path", ["native_decoder", "module_path_own_embedding"])
def test_every_proposal_equals_the_draft_run_from_scratch(tmp_path, tiny_dir, path):
    """The target's features taken by the native decoder (the CPU default: its one-call decode step copies
    them in C, its per-layer loop takes the prefill's) and by the module path's hooks; a draft with its own
    embedding and ``layers.0.`` names on the second."""
    from transformers import AutoModelForCausalLM

    own_embed = path != "native_decoder"
    folder = write_vllm_eagle3(tmp_path / "e3", seed=3, own_embed=own_embed, midlayer=not own_embed)
    config = {"method": "eagle3", "model": str(folder), "num_speculative_tokens": 3, "adaptive": False}
    # Chunked prefill (8 tokens a step), several sequences batched, arriving at different steps.
    llm = LLM(str(tiny_dir), block_size=4, max_num_batched_tokens=8, max_num_seqs=4, enable_prefix_caching=False,
              speculative_config=config)
    assert llm.runner.model.native_decoder is not None  # the default here: the capture must reach it
    native, captured_in_c = llm.runner.model.native_decoder, []
    if own_embed:
        llm.runner.model.native_decoder = None
    else:  # every decode-only step is the one-call step, the capture passed in
        one_call = native._decode_step
        native._decode_step = lambda *a: (captured_in_c.append(a[5] is not None), one_call(*a))[1]
    engine = llm.engine
    seen: list[tuple[str, int, list[int]]] = []
    proposer = engine.scheduler.speculator.proposer
    receive = proposer.receive
    proposer.receive = lambda rid, n, cands: (seen.append((rid, n, cands[0])), receive(rid, n, cands))[1]
    prompts = [[5 + i, 17, 33, 9 + i, 61, 12, 40, 8, 90 + i, 3, 44, 7][: 5 + 3 * i] for i in range(3)]
    reqs = [llm.make_request(p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)) for p in prompts]
    tokens = {r.request_id: list(p) for r, p in zip(reqs, prompts)}
    engine.add_request(reqs[0])
    pending = reqs[1:]
    while engine.has_unfinished_requests() or pending:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if pending:
            engine.add_request(pending.pop(0))
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), torch_dtype=torch.float32).eval()
    draft = Eagle3Draft.load(folder, read_arch(tiny_dir))
    embed = (lambda ids: draft.embed[ids]) if own_embed else hf.get_input_embeddings()
    assert len(seen) >= 10
    assert own_embed or (len(captured_in_c) >= 5 and all(captured_in_c)), captured_in_c
    with torch.no_grad():
        for rid, n, guess in seen:
            full = tokens[rid][:n]
            states = hf(torch.tensor([full]), output_hidden_states=True).hidden_states  # [j]: layer j's input
            aux = torch.cat([states[j][0] for j in draft.aux_layer_ids], dim=-1)
            assert guess == reference_proposal(draft, embed, aux, full, len(guess)), (rid, n)
    assert set(g for _, _, guess in seen for g in guess) <= set(draft.token_ids.tolist())


@pytest.mark.parametrize("scenario", ["chain_swap", "tree_chunked", "tree_recompute"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_tokens_never_change_with_eagle3(tmp_path, tiny_dir, scenario, sampling):
    folder = write_vllm_eagle3(tmp_path / "e3", seed=1)
    config = {"method": "eagle3", "model": str(folder), "num_speculative_tokens": 3, "adaptive": False,
              "num_candidates": 1 if scenario == "chain_swap" else 3}
    prompts = [[10 + i, 20, 30 + i, 40, 10 + i, 20, 30 + i, 40, 10 + i, 20] for i in range(4)] + [[7, 99, 3, 250]]
    if sampling == "greedy":
        params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)] * 5
    else:
        params = [SamplingParams(max_tokens=16, temperature=0.8, top_k=20, seed=i, logprobs=1, ignore_eos=True)
                  for i in range(5)]
    plain = LLM(str(tiny_dir), block_size=4).generate(prompts, params)
    engine_args = {"chain_swap": dict(num_kv_blocks=24, preemption_mode="swap"),
                   "tree_chunked": dict(max_num_batched_tokens=8, max_num_seqs=4),
                   "tree_recompute": dict(num_kv_blocks=24, preemption_mode="recompute")}[scenario]
    spec = LLM(str(tiny_dir), block_size=4, speculative_config=config, **engine_args)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    stats = spec.engine.scheduler.speculator.stats
    per_draft = 1 if scenario == "chain_swap" else 3  # a tree: more nodes than a chain's depth
    assert stats.num_drafts >= 10 and stats.num_draft_tokens > per_draft * stats.num_drafts
    assert_all_blocks_free_or_cached(spec.engine.scheduler)


def test_train_eagle3_on_a_tiny_model_writes_the_layout_it_loads(tiny_dir, tmp_path):
    from safetensors import safe_open

    from workers.eagle3_train import train_eagle3
    from workers.medusa_train import training_prompts

    llm = LLM(str(tiny_dir), block_size=4, max_model_len=256)
    summary = train_eagle3(llm, tmp_path / "e3", num_prompts=12, prompt_len=16, gen_len=24, lr=1e-2,
                           batch_size=4, draft_vocab_size=200, min_steps=40)
    assert summary["num_sequences"] == 12 and summary["optimizer_steps"] == 42  # 14 passes of 3 batches
    config = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 200
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and config["target_hidden_size"] == H
    with safe_open(str(tmp_path / "e3" / "model.safetensors"), framework="pt") as f:
        assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight", "norm.weight",
                "lm_head.weight", "d2t", "t2d"} <= set(f.keys())
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
        assert f.get_tensor("midlayer.self_attn.q_proj.weight").shape[1] == 2 * H
        assert float(f.get_tensor("midlayer.mlp.down_proj.weight").abs().sum()) > 0  # trained from its zero start
    # The draft vocabulary is the answers' most used tokens; t2d marks exactly the ids d2t maps to.
    assert d2t.shape == (200,) and int(t2d.sum()) == 200 and t2d[torch.arange(200) + d2t].all()
    spec = LLM(str(tiny_dir), block_size=4,
               speculative_config={"method": "eagle3", "model": str(tmp_path / "e3"), "adaptive": False})
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    # Prompts it was trained on: a random 8-layer model's answers are too noisy to generalize from 11
    # sequences, but a draft that learned anything from them guesses some of their tokens.
    prompts = training_prompts(llm, 12, 16, 0)[:3] + [[7, 99, 3, 250, 41]]
    assert [o.token_ids for o in spec.generate(prompts, params)] == [
        o.token_ids for o in llm.generate(prompts, params)]
    assert spec.engine.scheduler.speculator.stats.num_accepted_tokens > 0


def test_bench_spec_measures_eagle3_beside_eagle_and_the_capture_follows_the_runners_draft(tiny_dir, tmp_path):
    import argparse

    from cluster.bench.spec import run_spec

    eagle3 = write_vllm_eagle3(tmp_path / "e3", seed=2)
    llm = LLM(str(tiny_dir), block_size=4, speculative_config={"method": "eagle3", "model": str(eagle3)})
    native, runner = llm.runner.model.native_decoder, llm.runner
    assert native.aux_capture() is not None  # EAGLE-3's draft in the runner: features taken
    kept, runner.medusa = runner.medusa, None
    assert native.aux_capture() is None  # speculation off (bench spec's off mode): no features taken
    runner.medusa = kept
    # The tiny model's hidden size is TINY's; an EAGLE-1 draft of the same model goes beside it.
    eagle1 = write_vllm_eagle(tmp_path / "e1", seed=2)
    args = argparse.Namespace(batch_sizes=[2], workloads=["random"], input_len=12, output_len=6, fixed=False,
                              chain=False, rounds=1, json=str(tmp_path / "spec.json"),
                              also=[json.dumps({"method": "eagle", "model": str(eagle1), "adaptive": False})])
    engine = {"model": str(tiny_dir), "block_size": 4,
              "speculative_config": {"method": "eagle3", "model": str(eagle3), "adaptive": False}}
    assert run_spec(args, engine) == 0
    for case in json.loads((tmp_path / "spec.json").read_text())["cases"]:
        for mode in ("eagle3-fixed", "eagle-fixed"):
            assert case[mode]["identical_to_off"] and case[mode]["draft_tokens"] > 0, (mode, case)


def test_eagle3_tree_candidates_are_the_drafts_beam_from_scratch(tmp_path, tiny_dir):
    """EAGLE-2's trees over an EAGLE-3 draft: the beam of its confidence over the draft vocabulary,
    recomputed from scratch with the draft's scores spread over the target's ids (-inf elsewhere, as
    vLLM's compute_logits does), so ids and order are the target's."""
    from transformers import AutoModelForCausalLM

    from tests.models.test_eagle_tree import reference_tree

    folder = write_vllm_eagle3(tmp_path / "e3", seed=5, scale=0.5)
    config = {"method": "eagle3", "model": str(folder), "num_speculative_tokens": 3, "num_candidates": 3,
              "adaptive": False}
    llm = LLM(str(tiny_dir), block_size=4, max_num_batched_tokens=8, max_num_seqs=4, enable_prefix_caching=False,
              speculative_config=config)
    seen: list[tuple[str, int, list[list[int]]]] = []
    proposer = llm.engine.scheduler.speculator.proposer
    receive = proposer.receive
    proposer.receive = lambda rid, n, cands: (seen.append((rid, n, cands)), receive(rid, n, cands))[1]
    prompts = [[5 + i, 17, 33, 9 + i, 61, 12, 40, 8, 90 + i, 3, 44, 7][: 5 + 3 * i] for i in range(3)]
    reqs = [llm.make_request(p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)) for p in prompts]
    tokens = {r.request_id: list(p) for r, p in zip(reqs, prompts)}
    for r in reqs:
        llm.engine.add_request(r)
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            tokens[out.request_id] += out.new_token_ids
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), torch_dtype=torch.float32).eval()
    draft = Eagle3Draft.load(folder, read_arch(tiny_dir))

    def spread_logits(f: torch.Tensor) -> torch.Tensor:
        out = torch.full((f.shape[0], V), float("-inf"))
        out[:, draft.token_ids] = draft.logits(f)
        return out

    assert len(seen) >= 6
    with torch.no_grad():
        for rid, n, cands in seen:
            full = tokens[rid][:n]
            states = hf(torch.tensor([full]), output_hidden_states=True).hidden_states
            g = draft.fc(torch.cat([states[j][0] for j in draft.aux_layer_ids], dim=-1))  # H wide: used as is
            assert len(cands) == 3 and len({tuple(c) for c in cands}) == 3
            expected = reference_tree(draft, hf.get_input_embeddings(), spread_logits, g, full, 3, len(cands[0]))
            assert cands == expected, (rid, n)
