"""Tensor parallelism end to end on a real local Ray (gloo on CPU).

Greedy outputs with TP > 1 are token-identical to TP = 1 and to Hugging Face
transformers for: heads that divide evenly (4 q / 2 KV heads over 2 ranks);
uneven shards (6 q / 3 KV heads, intermediate 129 and vocab 511 over 2 ranks,
with random q/k/v/o and MLP biases, so row-parallel biases must be added
once); KV heads replicated (6 q / 2 KV heads over 3 ranks); and the default
model (9 q / 3 KV heads over 2 ranks) in one mixed batch and with preemption
by swap, where each rank swaps its own KV shard. Seeded sampling gives the
same tokens whatever the TP size. Ranks join the caller's placement group
and their processes exit on shutdown.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import ray
import torch

from cluster.shared.chat_template import ChatTemplate
from cluster.shared.config import SpeculativeConfig
from cluster.shared.types import SamplingParams
from tests.factories import OracleProposer, TreeOracleProposer, hf_greedy, make_tiny_model_dir
from tests.unit.engine_fakes import assert_all_blocks_free_or_cached
from workers.engine.spec_decode import Speculator
from workers.llm import LLM
from workers.model.loader import resolve_model

pytestmark = pytest.mark.usefixtures("ray_local")

PROMPT_LENS = [3, 9, 17, 24, 33, 6]
MAX_TOKENS = [12, 8, 10, 6, 9, 11]

# name -> (tensor_parallel_size, overrides of tests.factories.TINY)
TINY_CASES = {
    "even_gqa": (2, {}),
    "uneven": (2, dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96, intermediate_size=129,
                       vocab_size=511, attention_bias=True, mlp_bias=True)),
    "replicated_kv": (3, dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=96)),
    "qwen3_qk_norm": (2, dict(family="qwen3")),  # per-head q/k norms: replicated on every rank
    "phi3_fused": (2, dict(family="phi3")),  # a fused qkv / gate_up checkpoint, split before it is sharded
    "phi3_longrope": (2, dict(family="phi3_longrope")),  # short, long and crossing sequences: every rank offsets
    "gemma3_sandwich": (2, dict(family="gemma3")),  # four norms, q/k norms, two RoPE bases: replicated
    "gemma2_softcaps": (2, dict(family="gemma2")),  # capped scores per head; each rank caps its logits slice
    "mixtral_experts": (2, dict(family="mixtral")),  # every expert's intermediate rows split, the router replicated
    "qwen2_moe_shared": (2, dict(family="qwen2_moe")),  # and the shared expert's; a dense layer beside
}

DEFAULT_TEXTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea and the wind that moves over it at night.",
    "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker who "
    "repaired every clock in the valley except his own.",
    "List three reasons why continuous batching improves the throughput of an LLM server. " * 3,
    "1, 2, 3, 4, 5, 6, 7, 8,",
]
DEFAULT_MAX_TOKENS = [14, 10, 16, 8, 12, 18]


@dataclass
class Case:
    model_dir: Path
    prompts: list[list[int]]
    max_tokens: list[int]
    expected: list[list[int]]  # HF greedy


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def seeded(n: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True)


def randomize_biases(model_dir: Path) -> None:
    """Gives every bias of a saved HF model random values (HF initializes them to 0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.2)
    model.save_pretrained(model_dir)


def token_ids(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


def wait_until_gone(pids: list[int], timeout: float = 20.0) -> list[int]:
    """The pids still alive after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.2)
    return alive


def free_resources_become(names: list[str], expected: list[float], timeout: float = 20.0) -> bool:
    """Whether Ray's free amounts of ``names`` reach ``expected`` (the view
    lags the scheduler by up to a heartbeat; absent means 0)."""
    deadline = time.monotonic() + timeout
    while True:
        free = ray.available_resources()
        if [free.get(name, 0.0) for name in names] == expected:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


@pytest.fixture(scope="module", params=list(TINY_CASES))
def tiny(request, tmp_path_factory) -> tuple[int, Case]:
    tp, overrides = TINY_CASES[request.param]
    overrides = dict(overrides)
    model_dir = make_tiny_model_dir(overrides.pop("family", "llama"), tmp_path_factory.mktemp(request.param),
                                    **overrides)
    if overrides.get("attention_bias"):
        randomize_biases(model_dir)
    vocab = overrides.get("vocab_size", 512)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]
    return tp, Case(model_dir, prompts, MAX_TOKENS, hf_greedy(model_dir, prompts, MAX_TOKENS))


def test_tiny_models_match_tp1_and_hf(tiny):
    tp, case = tiny
    sampled = [seeded(n, seed=100 + i) for i, n in enumerate(case.max_tokens)]
    single = LLM(str(case.model_dir), block_size=4)
    assert token_ids(single.generate(case.prompts, [greedy(n) for n in case.max_tokens])) == case.expected
    single_sampled = token_ids(single.generate(case.prompts, sampled))
    with LLM(str(case.model_dir), block_size=4, tensor_parallel_size=tp) as llm:
        assert token_ids(llm.generate(case.prompts, [greedy(n) for n in case.max_tokens])) == case.expected
        # Rank 0 samples over the gathered logits with the engine's seed: same draws as one process.
        assert token_ids(llm.generate(case.prompts, sampled)) == single_sampled
        # Speculation: every rank expands the drafts alike (a chain, or a tree whose accepted
        # branch every rank moves into place next step); rank 0 verifies them.
        for config, make in ((SpeculativeConfig(num_speculative_tokens=3, adaptive=False), OracleProposer),
                             (SpeculativeConfig(num_speculative_tokens=3, adaptive=False, num_candidates=3),
                              TreeOracleProposer)):
            for expected, params in ((case.expected, [greedy(n) for n in case.max_tokens]),
                                     (single_sampled, sampled)):
                oracle = make({tuple(p): e for p, e in zip(case.prompts, expected)})
                llm.engine.scheduler.speculator = Speculator(config, proposer=oracle)
                assert token_ids(llm.generate(case.prompts, params)) == expected
                stats = llm.engine.scheduler.speculator.stats
                assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert_all_blocks_free_or_cached(llm.engine.scheduler)


def test_too_many_ranks_is_refused_before_any_rank_starts(tiny):
    _, case = tiny
    with pytest.raises(ValueError, match=r"use tensor_parallel_size <= \d+"):
        LLM(str(case.model_dir), tensor_parallel_size=16)


@pytest.fixture(scope="module")
def default_case() -> Case:
    from tokenizers import Tokenizer

    model_dir = resolve_model(None)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    template = ChatTemplate.from_model_dir(model_dir)
    texts = [template.render([{"role": "user", "content": t}]) if i % 2 else t for i, t in enumerate(DEFAULT_TEXTS)]
    prompts = [tok.encode(t).ids for t in texts]
    return Case(model_dir, prompts, DEFAULT_MAX_TOKENS, hf_greedy(model_dir, prompts, DEFAULT_MAX_TOKENS))


@pytest.mark.slow
def test_default_model_one_batch_matches_tp1_and_hf(default_case):
    params = [greedy(n) for n in default_case.max_tokens]
    single = LLM(max_model_len=512)
    assert token_ids(single.generate(default_case.prompts, params)) == default_case.expected
    # A structured-output request beside them: its masks reach rank 0 only, which samples.
    schema = {"type": "object", "properties": {"answer": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["answer", "n"], "additionalProperties": False}
    constrained = SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": schema})
    json_tp1 = single.generate(default_case.prompts[1], constrained)[0].token_ids
    with LLM(tensor_parallel_size=2, max_model_len=512) as llm:
        pids = llm.runner.rank_pids
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        assert token_ids(llm.generate(default_case.prompts, params)) == default_case.expected
        assert llm.generate(default_case.prompts[1], constrained)[0].token_ids == json_tp1
        assert_all_blocks_free_or_cached(llm.engine.scheduler)
    assert wait_until_gone(pids) == []
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(default_case.prompts[:1], params[:1])


class SwapCounter:
    """Wraps a runner; counts the steps that swap blocks out and in."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.num_swap_out = self.num_swap_in = 0

    def execute(self, sched):
        self.num_swap_out += bool(sched.swap_out)
        self.num_swap_in += bool(sched.swap_in)
        return self.runner.execute(sched)


@pytest.mark.slow
def test_default_model_preempted_by_swap_matches_hf(default_case):
    params = [greedy(n) for n in default_case.max_tokens]
    # No prefix caching: a swapped-in sequence would share still-cached device blocks instead of copying.
    with LLM(tensor_parallel_size=2, max_model_len=512, num_kv_blocks=10, preemption_mode="swap",
             swap_space=0.05, enable_prefix_caching=False) as llm:
        counter = SwapCounter(llm.engine.runner)
        llm.engine.runner = counter
        assert token_ids(llm.generate(default_case.prompts, params)) == default_case.expected
        assert llm.engine.scheduler.num_preemptions_total > 0
        assert counter.num_swap_out > 0 and counter.num_swap_in > 0
        assert_all_blocks_free_or_cached(llm.engine.scheduler)


def test_ranks_run_in_the_callers_placement_group(tmp_path):
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    # Defined here so Ray pickles it by value: Ray workers cannot import this test module.
    @ray.remote(num_cpus=0.5)
    class TPDriver:
        """Plays the Serve replica: builds a TP engine inside its placement group."""

        def __init__(self, model_dir: str) -> None:
            from workers.llm import LLM

            self.llm = LLM(model_dir, block_size=4, tensor_parallel_size=2)

        def generate(self, prompts, max_tokens) -> list[list[int]]:
            from cluster.shared.types import SamplingParams

            params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
            return [o.token_ids for o in self.llm.generate(prompts, params)]

        def shutdown(self) -> list[int]:
            self.llm.shutdown()
            return self.llm.runner.rank_pids

    model_dir = make_tiny_model_dir("llama", tmp_path / "model")
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    expected = hf_greedy(model_dir, prompts, [6, 6])
    # Bundle 0 for the driver (the replica), one bundle per rank, like cluster/app/builder.py.
    pg = placement_group([{"CPU": 0.5}, {"CPU": 0.25}, {"CPU": 0.25}], strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)
    rank_bundles = [f"CPU_group_{index}_{pg.id.hex()}" for index in (1, 2)]
    assert free_resources_become(rank_bundles, [0.25, 0.25])
    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0)
    driver = TPDriver.options(scheduling_strategy=strategy).remote(str(model_dir))
    try:
        assert ray.get(driver.generate.remote(prompts, [6, 6]), timeout=120) == expected
        # The ranks took the rank bundles (Ray drops fully used resources from the free list).
        assert free_resources_become(rank_bundles, [0.0, 0.0])
        pids = ray.get(driver.shutdown.remote(), timeout=60)
        assert wait_until_gone(pids) == []
    finally:
        ray.kill(driver)
        remove_placement_group(pg)
