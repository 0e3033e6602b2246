"""Multi-LoRA: greedy tokens identical to transformers running PEFT's own
(unmerged) forward in float32, for three random adapters of different ranks
and targets, alone and mixed with base requests in one batch, under chunked
prefill, preemption and speculation; the prefix cache keyed by the adapter's
content; bad adapters refused with a message and nothing half-loaded."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest
import torch

from cluster.shared.types import LoRARequest, SamplingParams
from tests.factories import make_hf_config, make_hf_model, save_tiny_tokenizer
from tests.unit.engine_fakes import assert_all_blocks_free_or_cached
from workers.llm import LLM

# (rank, alpha, targets, rslora): ranks and targets differ; one adapter every linear layer.
ADAPTERS = {
    "qv4": (4, 8, ["q_proj", "v_proj"], False),
    "all8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "od16": (16, 8, ["o_proj", "down_proj", "up_proj"], True),
}
PROMPT_LENS = [5, 13, 21, 30, 9, 40]
MAX_TOKENS = [10, 8, 12, 6, 14, 9]


def save_adapter(base_dir: Path, out: Path, rank: int, alpha: int, targets: list[str], rslora: bool,
                 seed: int) -> Path:
    """A PEFT LoRA adapter with random A and B (PEFT starts B at zero) saved as safetensors."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                                            lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.15)
    model.save_pretrained(out)
    return out


def peft_greedy(base_dir: Path, adapter: Path | None, prompts: list[list[int]], max_tokens: list[int]
                ) -> list[list[int]]:
    """transformers' greedy continuations with PEFT's unmerged forward (or the base model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_tokens):
            ids = torch.tensor([prompt])
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 do_sample=False, pad_token_id=0)
            outs.append(gen[0, len(prompt):].tolist())
    return outs


class LoRACase:
    def __init__(self, root: Path, family: str) -> None:
        self.base = root / "base"
        make_hf_model(make_hf_config(family), seed=3).save_pretrained(self.base)
        save_tiny_tokenizer(self.base, make_hf_config(family).vocab_size)  # w8a8 calibrates on text
        rng = random.Random(11)
        vocab = make_hf_config(family).vocab_size
        self.prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]
        self.prompts[-1] = self.prompts[3][:24] + self.prompts[-1][24:]  # a shared prefix
        self.adapters = {name: save_adapter(self.base, root / name, *spec, seed=i)
                         for i, (name, spec) in enumerate(ADAPTERS.items())}
        self.expected = {name: peft_greedy(self.base, path, self.prompts, MAX_TOKENS)
                         for name, path in [(None, None), *self.adapters.items()]}

    def request(self, name: str | None) -> LoRARequest | None:
        return None if name is None else LoRARequest(name, 1, str(self.adapters[name]))

    def llm(self, **kwargs) -> LLM:
        args = dict(enable_lora=True, max_loras=3, max_lora_rank=16, block_size=4, seed=0)
        return LLM(str(self.base), **{**args, **kwargs})


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> LoRACase:
    return LoRACase(tmp_path_factory.mktemp("lora-llama"), "llama")


def run(llm: LLM, case: LoRACase, names: list[str | None]) -> list[list[int]]:
    outs = llm.generate(case.prompts, [greedy(n) for n in MAX_TOKENS], lora_request=[case.request(n) for n in names])
    return [o.token_ids for o in outs]


def expected_for(case: LoRACase, names: list[str | None]) -> list[list[int]]:
    return [case.expected[name][i] for i, name in enumerate(names)]


def test_adapters_change_the_output(llama):
    """The test can fail: each adapter's tokens differ from the base model's."""
    for name in ADAPTERS:
        assert llama.expected[name] != llama.expected[None], name


@pytest.mark.parametrize("name", [None, *ADAPTERS])
def test_each_adapter_alone_matches_peft(llama, name):
    llm = llama.llm()
    assert llm.runner.model.native_decoder is not None  # it runs the side paths (native_decoder.py)
    assert run(llm, llama, [name] * len(PROMPT_LENS)) == llama.expected[name]
    assert_all_blocks_free_or_cached(llm.engine.scheduler)


MIXED = ["qv4", None, "all8", "od16", "all8", None]
SCENARIOS = {
    "one_batch": {},
    "chunked_prefill": dict(max_num_batched_tokens=16, max_num_seqs=8),
    "swap": dict(num_kv_blocks=24, preemption_mode="swap", swap_space=0.05),
    "recompute": dict(num_kv_blocks=24, preemption_mode="recompute"),
    "one_adapter_a_step": dict(max_loras=1),
    "ngram": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_adapters_mixed_with_base_requests(llama, scenario):
    llm = llama.llm(**SCENARIOS[scenario])
    assert run(llm, llama, MIXED) == expected_for(llama, MIXED)
    # A second round: prefix hits on every request's own adapter chain.
    assert run(llm, llama, MIXED) == expected_for(llama, MIXED)
    assert_all_blocks_free_or_cached(llm.engine.scheduler)
    if scenario in ("swap", "recompute"):
        assert llm.engine.scheduler.num_preemptions_total > 0


def test_max_loras_bounds_the_adapters_in_a_step(llama):
    llm = llama.llm(max_loras=2)
    seen: list[int] = []
    original = llm.runner.execute

    def spy(sched):
        seen.append(len({r.lora_slot for r in sched.scheduled if r.lora_slot >= 0}))
        return original(sched)

    llm.runner.execute = spy
    names = ["qv4", "all8", "od16", "qv4", "all8", "od16"]
    assert run(llm, llama, names) == expected_for(llama, names)
    assert max(seen) == 2


def test_prefix_cache_is_keyed_by_adapter_content(llama, tmp_path):
    llm = llama.llm(max_loras=2, max_cpu_loras=4)
    prompt = llama.prompts[5]
    copy = Path(shutil.copytree(llama.adapters["all8"], tmp_path / "same-weights"))

    def cached(request: LoRARequest | None) -> int:
        return llm.generate([prompt], greedy(2), lora_request=request)[0].num_cached_tokens

    assert cached(LoRARequest("all8", 1, str(llama.adapters["all8"]))) == 0
    # Another name, the same weights: the same blocks.
    assert cached(LoRARequest("alias", 2, str(copy))) == 36
    # Another adapter, and the base model, never read them.
    assert cached(LoRARequest("qv4", 3, str(llama.adapters["qv4"]))) == 0
    assert cached(None) == 0
    # The name loaded again with other weights: no stale KV, and its own (PEFT's) tokens.
    llm.engine.lora.unload("alias", ())
    shutil.rmtree(copy)
    shutil.copytree(llama.adapters["od16"], copy)
    out = llm.generate([prompt], greedy(MAX_TOKENS[5]), lora_request=LoRARequest("alias", 2, str(copy)))[0]
    assert out.num_cached_tokens == 0 and out.token_ids == llama.expected["od16"][5]


def test_lru_keeps_max_cpu_loras_and_never_evicts_one_in_use(llama):
    llm = llama.llm(max_loras=1, max_cpu_loras=1)
    names = ["qv4", "all8", "od16", None]
    assert run(llm, llama, names + [None, None]) == expected_for(llama, names + [None, None])
    manager = llm.engine.lora
    assert len(manager.names()) == 1 and manager.num_evictions >= 2


def test_bad_adapters_are_refused_with_a_reason(llama, tmp_path):
    llm = llama.llm(max_lora_rank=8)
    prompt = llama.prompts[0]

    def refused(request: LoRARequest, *words: str) -> None:
        with pytest.raises(ValueError) as info:
            llm.generate([prompt], greedy(2), lora_request=request)
        for word in words:
            assert word in str(info.value)

    refused(LoRARequest("big", 1, str(llama.adapters["od16"])), "rank 16", "max_lora_rank 8")
    refused(LoRARequest("gone", 1, str(tmp_path / "missing")), "no such folder")
    refused(LoRARequest("nameless", 1, ""), "not loaded", "no path")
    corrupt = Path(shutil.copytree(llama.adapters["qv4"], tmp_path / "corrupt"))
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    refused(LoRARequest("corrupt", 1, str(corrupt)), "corrupt")
    # An adapter made for another model: shapes that do not fit.
    other = tmp_path / "other-base"
    make_hf_model(make_hf_config("llama", hidden_size=48), seed=1).save_pretrained(other)
    wrong = save_adapter(other, tmp_path / "wrong", 4, 8, ["q_proj"], False, seed=5)
    refused(LoRARequest("wrong", 1, str(wrong)), "do not fit")
    head = save_adapter(llama.base, tmp_path / "head", 4, 8, ["lm_head"], False, seed=6)
    refused(LoRARequest("head", 1, str(head)), "not supported")
    assert llm.engine.lora.names() == []  # nothing half-loaded
    # The engine still serves, base and adapters.
    assert run(llm, llama, MIXED[:2] + [None] * 4)[:2] == expected_for(llama, MIXED[:2])


def test_lora_needs_enable_lora(llama):
    llm = LLM(str(llama.base), block_size=4)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate([llama.prompts[0]], greedy(2), lora_request=llama.request("qv4"))


def test_lora_modules_load_at_start(llama):
    llm = llama.llm(lora_modules=[f"sql={llama.adapters['qv4']}"])
    assert llm.engine.lora.names() == ["sql"]
    out = llm.generate([llama.prompts[1]], greedy(MAX_TOKENS[1]), lora_request=LoRARequest("sql"))[0]
    assert out.token_ids == llama.expected["qv4"][1]


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_other_families_match_peft(tmp_path, family):
    case = LoRACase(tmp_path, family)
    llm = case.llm(max_num_batched_tokens=16, max_num_seqs=8)
    for name in ADAPTERS:
        assert case.expected[name] != case.expected[None], name
    assert run(llm, case, MIXED) == expected_for(case, MIXED)


def test_draft_model_speculation_verifies_with_the_adapter(llama):
    """The draft (the base model cut to one layer) knows no adapter; the
    adapted target verifies its drafts, so the tokens stay PEFT's."""
    llm = llama.llm(speculative_config={"method": "draft_model", "num_speculative_tokens": 3,
                                        "draft_num_layers": 1, "adaptive": False})
    assert run(llm, llama, MIXED) == expected_for(llama, MIXED)
    assert llm.engine.scheduler.speculator.stats.num_draft_tokens > 0


@pytest.mark.parametrize("quantization", ["int4", "int8", "w8a8"])
def test_quantized_base_mixed_equals_each_alone(llama, quantization):
    """On a quantized base (the adapter stays float) a request's tokens are
    the same in a mixed batch as alone."""
    llm = llama.llm(quantization=quantization)
    mixed = run(llm, llama, MIXED)
    alone = [llm.generate([p], greedy(n), lora_request=llama.request(name))[0].token_ids
             for p, n, name in zip(llama.prompts, MAX_TOKENS, MIXED)]
    assert mixed == alone
    assert mixed != run(llm, llama, [None] * len(MIXED))  # the adapters still change the output


def test_adapters_by_name_from_the_dynamic_folder(llama, tmp_path):
    shutil.copytree(llama.adapters["qv4"], tmp_path / "team-a")
    llm = llama.llm(dynamic_lora_loading_path=str(tmp_path))
    out = llm.generate([llama.prompts[2]], greedy(MAX_TOKENS[2]), lora_request=LoRARequest("team-a"))[0]
    assert out.token_ids == llama.expected["qv4"][2]
    with pytest.raises(ValueError, match="no such folder"):
        llm.generate([llama.prompts[2]], greedy(2), lora_request=LoRARequest("team-b"))


def test_allowed_token_ids_and_n_with_an_adapter(llama):
    """A constraint masks the adapted model's tokens; n choices fork with the adapter."""
    llm = llama.llm()
    lora = llama.request("all8")
    allowed = sorted(set(llama.expected["all8"][0]) | {5, 6, 7})
    choice = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed)
    out = llm.generate([llama.prompts[0]], choice, lora_request=lora)[0]
    assert all(t in allowed for t in out.token_ids)
    assert out.token_ids[:2] == llama.expected["all8"][0][:2]  # the adapter's own first choices are allowed
    forks = llm.generate([llama.prompts[1]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[1], n=3,
                                                            ignore_eos=True), lora_request=lora)[0]
    assert [c.token_ids for c in forks.outputs] == [llama.expected["all8"][1]] * 3


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_families_take_attention_adapters(tmp_path, family):
    base = tmp_path / "base"
    make_hf_model(make_hf_config(family), seed=3).save_pretrained(base)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in PROMPT_LENS[:4]]
    adapter = save_adapter(base, tmp_path / "attn", 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], False, seed=9)
    expected = peft_greedy(base, adapter, prompts, MAX_TOKENS[:4])
    assert expected != peft_greedy(base, None, prompts, MAX_TOKENS[:4])
    llm = LLM(str(base), enable_lora=True, block_size=4, max_num_batched_tokens=16, max_num_seqs=8)
    outs = llm.generate(prompts, [greedy(n) for n in MAX_TOKENS[:4]],
                        lora_request=[LoRARequest("attn", 1, str(adapter)), None, LoRARequest("attn", 1, str(adapter)),
                                      LoRARequest("attn", 1, str(adapter))])
    base_tokens = peft_greedy(base, None, prompts[1:2], MAX_TOKENS[1:2])[0]
    assert [o.token_ids for o in outs] == [expected[0], base_tokens, expected[2], expected[3]]
    if family == "qwen2_moe":  # gate_proj and up_proj: the experts' (refused), the shared expert's and the dense layer's
        experts = save_adapter(base, tmp_path / "experts", 4, 8, ["gate_proj", "up_proj"], False, seed=10)
        with pytest.raises(ValueError, match="experts.* not supported|not supported.*MoE experts"):
            llm.generate([prompts[0]], greedy(2), lora_request=LoRARequest("experts", 2, str(experts)))


def test_an_adapter_read_ahead_is_only_installed_on_the_engine_thread(llama):
    """The replica reads a new adapter on another thread (``prefetch``): the
    engine thread then installs it without reading the folder again."""
    import threading

    llm = llama.llm()
    manager = llm.engine.lora
    reads = []
    stage = manager.slots.stage
    manager.slots.stage = lambda *args: reads.append(args) or stage(*args)
    reader = threading.Thread(target=manager.prefetch, args=(llama.request("od16"),))
    reader.start()
    reader.join()
    assert run(llm, llama, ["od16"] * len(PROMPT_LENS)) == llama.expected["od16"]
    assert reads == [] and manager.num_loads == 1
    manager.prefetch(llama.request("od16"))  # loaded: nothing to read
    with pytest.raises(ValueError, match="no such folder"):
        manager.prefetch(LoRARequest("gone", 1, "/nonexistent/adapter"))


def test_medusa_heads_propose_and_the_adapted_model_verifies(llama, tmp_path):
    from workers.model.loader import read_arch
    from workers.model.medusa import MedusaHeads

    arch = read_arch(llama.base)
    MedusaHeads(arch.hidden_size, arch.vocab_size, num_heads=3).save(tmp_path / "heads")
    llm = llama.llm(speculative_config={"method": "medusa", "model": str(tmp_path / "heads"),
                                        "num_speculative_tokens": 3, "adaptive": False})
    assert run(llm, llama, MIXED) == expected_for(llama, MIXED)
    assert llm.engine.scheduler.speculator.stats.num_draft_tokens > 0


def test_a_grammar_constrains_the_adapted_model(llama):
    """A regex holds over an adapter's output, and the adapter still decides
    within it: its text differs from the base model's under the same grammar."""
    import re

    from cluster.shared.structured import StructuredOutputsParams

    llm = llama.llm()
    pattern = r"[a-z ]{4,24}\."
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=pattern))
    prompts = llama.prompts[:4]
    texts = {name: [o.text for o in llm.generate(prompts, params, lora_request=llama.request(name))]
             for name in (None, "all8", "qv4")}
    for outs in texts.values():
        assert all(re.fullmatch(pattern, t) for t in outs), outs
    assert texts["all8"] != texts[None] and texts["qv4"] != texts[None]
