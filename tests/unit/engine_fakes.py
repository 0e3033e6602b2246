"""Factories and a fake model runner for the control-plane tests (no torch).

``FakeRunner`` simulates the paged KV cache: every slot holds the
``(token, position)`` a step wrote there, swaps copy slots between a device
and a CPU array, and before a step writes anything it reads every request's
cached context back through its block table and checks it against the true
tokens. A wrong block id, a shared block that was overwritten, a swap copied
in the wrong order or a same-step dependency on KV not yet written fails
there. The sampled token is a function of the context, so outputs also
diverge when the context is wrong.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence as Seq

from cluster.shared.config import SchedulerConfig
from cluster.shared.types import SamplingParams
from workers.engine.block_pool import BlockPool
from workers.engine.kv_manager import KVCacheManager
from workers.engine.outputs import ModelOutput, SchedulerOutput
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence
from workers.engine.spec_decode import Speculator

BLOCK_SIZE = 4
FINGERPRINT = "test-model"
VOCAB = 1000


def make_block_pool(num_blocks: int = 8, block_size: int = BLOCK_SIZE, enable_caching: bool = True) -> BlockPool:
    return BlockPool(num_blocks, block_size, enable_caching=enable_caching)


def make_kv_manager(
    num_blocks: int = 8, num_cpu_blocks: int = 0, block_size: int = BLOCK_SIZE, enable_caching: bool = True
) -> KVCacheManager:
    swap = BlockPool(num_cpu_blocks, block_size, enable_caching=False) if num_cpu_blocks else None
    return KVCacheManager(BlockPool(num_blocks, block_size, enable_caching=enable_caching), swap)


def make_scheduler(
    num_blocks: int = 8,
    num_cpu_blocks: int = 8,
    *,
    block_size: int = BLOCK_SIZE,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    enable_chunked_prefill: bool = True,
    preemption_mode: str = "swap",
    enable_caching: bool = True,
    max_model_len: int = 256,
    eos_token_ids: Seq[int] = (),
    sliding_window: Optional[int] = None,
    speculator: Optional[Speculator] = None,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=enable_chunked_prefill,
        preemption_mode=preemption_mode,
    )
    kv = make_kv_manager(num_blocks, num_cpu_blocks, block_size, enable_caching)
    return Scheduler(config, kv, max_model_len=max_model_len, eos_token_ids=eos_token_ids,
                     sliding_window=sliding_window, speculator=speculator)


def make_request(
    request_id: str,
    prompt: Seq[int] | int,
    *,
    max_tokens: int = 4,
    priority: int = 0,
    arrival_time: float = 0.0,
    cache_salt: str = "",
    block_size: int = BLOCK_SIZE,
    **params,
) -> Sequence:
    """A waiting sequence; an int ``prompt`` means tokens 100, 101, ... of that length."""
    tokens = list(range(100, 100 + prompt)) if isinstance(prompt, int) else list(prompt)
    return Sequence(
        request_id,
        tokens,
        SamplingParams(max_tokens=max_tokens, **params),
        block_size=block_size,
        model_fingerprint=FINGERPRINT,
        cache_salt=cache_salt,
        priority=priority,
        arrival_time=arrival_time,
    )


def next_token(token_ids: Seq[int]) -> int:
    """The fake model: a deterministic function of the whole context."""
    acc = len(token_ids)
    for i, t in enumerate(token_ids):
        acc = (acc * 31 + t * (i + 7)) % 1_000_003
    return acc % VOCAB


def fork_token(context: Seq[int], index: int) -> int:
    """The fake model's first token of choice ``index`` of a parallel-sampling request
    (choice 0 samples ``next_token``): distinct per choice, so the choices diverge."""
    return (next_token(context) + index) % VOCAB


def echo_token(token_ids: Seq[int]) -> int:
    """A fake model that mostly repeats itself (the token 4 back, two times in
    three), so n-gram proposals are often right and often wrong."""
    h = next_token(token_ids)
    return token_ids[-4] if len(token_ids) >= 4 and h % 3 else h


def fixed_speculator(k: int = 3) -> Speculator:
    """Proposes up to ``k`` tokens whenever a 1- to 3-gram repeats (not adaptive)."""
    from cluster.shared.config import SpeculativeConfig

    return Speculator(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3,
                                        adaptive=False))


class FakeRunner:
    """Executes ``SchedulerOutput``s over a simulated KV cache (see module doc)."""

    def __init__(
        self,
        num_blocks: int,
        num_cpu_blocks: int = 0,
        block_size: int = BLOCK_SIZE,
        model: Callable[[Seq[int]], int] = next_token,
        window: Optional[int] = None,
    ) -> None:
        self.block_size = block_size
        self.window = window  # a sliding-window model: it reads (and checks) the last `window` positions only
        self.device: list[list[Optional[tuple[int, int]]]] = [[None] * block_size for _ in range(num_blocks)]
        self.cpu: list[list[Optional[tuple[int, int]]]] = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.model = model
        self.steps: list[SchedulerOutput] = []

    @classmethod
    def for_scheduler(cls, scheduler: Scheduler, model: Callable[[Seq[int]], int] = next_token) -> "FakeRunner":
        kv = scheduler.kv_manager
        num_cpu = kv.swap_pool.num_blocks if kv.swap_pool is not None else 0
        return cls(kv.num_device_blocks, num_cpu, kv.block_size, model, scheduler.sliding_window)

    def _slot(self, block_ids: Seq[int], pos: int) -> Optional[tuple[int, int]]:
        return self.device[block_ids[pos // self.block_size]][pos % self.block_size]

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        self.steps.append(sched)
        bs = self.block_size
        moved = [self.device[src // bs][src % bs] for src, _ in sched.kv_moves]  # all read, then written
        for (_, dst), entry in zip(sched.kv_moves, moved):
            self.device[dst // bs][dst % bs] = entry
        for device_block, cpu_block in sched.swap_out:
            self.cpu[cpu_block] = list(self.device[device_block])
        for cpu_block, device_block in sched.swap_in:
            self.device[device_block] = list(self.cpu[cpu_block])
        # Read every cached context before this step writes anything.
        contexts = []
        for req in sched.scheduled:
            truth = list(req.prompt_token_ids) + list(req.output_token_ids)
            drafts = list(req.spec_token_ids)
            known = req.input_token_ids[: len(req.input_token_ids) - len(drafts)]
            assert req.input_token_ids == known + drafts, req.request_id
            assert known == truth[req.num_computed_tokens : req.seq_len - len(drafts)], req.request_id
            first = 0 if self.window is None else max(0, req.num_computed_tokens - self.window + 1)
            cached = [self._slot(req.block_ids, p) for p in range(first, req.num_computed_tokens)]
            expected = [(t, p) for p, t in enumerate(truth[: req.num_computed_tokens])][first:]
            assert cached == expected, f"{req.request_id}: KV cache corrupted"
            context = [t for t, _ in cached] + req.input_token_ids
            contexts.append(context if self.window is None else context[-self.window :])
            if req.num_sample_tokens:
                assert req.seq_len - len(drafts) == len(truth), req.request_id
                assert req.num_sample_tokens == 1 + len(drafts), req.request_id
        sampled = []
        for req, context in zip(sched.scheduled, contexts):
            drafts = list(req.spec_token_ids)
            parents = list(req.spec_parents) or list(range(-1, len(drafts) - 1))
            depth: list[int] = []
            for j, token in enumerate(req.input_token_ids):
                slot_pos = req.num_computed_tokens + j
                pos = slot_pos  # a tree's proposal sits at its slot, holding its own position (its depth)
                if j > len(req.input_token_ids) - 1 - len(drafts):
                    i = j - (len(req.input_token_ids) - len(drafts))
                    depth.append(1 + (depth[parents[i]] if parents[i] >= 0 else 0))
                    pos = req.num_computed_tokens + len(req.input_token_ids) - len(drafts) - 1 + depth[i]
                self.device[req.block_ids[slot_pos // bs]][slot_pos % bs] = (token, pos)
            sampled.append(self._verify(context, drafts, parents) if req.num_sample_tokens else [])
        forks = [[(fork_token(context, j + 1), None) for j in range(len(req.fork_params))] if req.fork_params else None
                 for req, context in zip(sched.scheduled, contexts)]
        return ModelOutput(sampled_token_ids=sampled, logprobs=[None] * len(sampled),
                           fork_samples=forks if any(f is not None for f in forks) else None)

    def _verify(self, context: list[int], drafts: list[int], parents: list[int]) -> list[int]:
        """The model's token after the context, then after each draft it agrees
        with, walking the tree of drafts (a chain: each after the last) from
        the context without them: greedy verification."""
        base = context[: len(context) - len(drafts)]
        out, path, node = [], [], -1
        while True:
            token = self.model(base + path)
            out.append(token)
            node = next((j for j, p in enumerate(parents) if p == node and drafts[j] == token), None)
            if node is None:
                return out
            path.append(token)


def step(scheduler: Scheduler, runner: FakeRunner):
    """One schedule / execute / update round; checks integrity after it."""
    sched = scheduler.schedule()
    scheduler.check_integrity()
    results = scheduler.update_from_output(sched, runner.execute(sched))
    scheduler.check_integrity()
    return sched, results


def run_to_completion(
    scheduler: Scheduler, runner: FakeRunner, max_steps: int = 1000
) -> dict[str, Sequence]:
    """Steps until nothing is unfinished; returns the finished sequences by id."""
    finished: dict[str, Sequence] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return finished
        _, results = step(scheduler, runner)
        for seq, _, _ in results:
            if seq.is_finished:
                finished[seq.request_id] = seq
    raise AssertionError(f"not finished after {max_steps} steps")


def expected_output(prompt: Seq[int], max_tokens: int, model: Callable[[Seq[int]], int] = next_token,
                    window: Optional[int] = None) -> list[int]:
    """What an unpressured run generates (no stops but max_tokens); with
    ``window`` the model sees only the last ``window`` tokens."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(model(tokens if window is None else tokens[-window:]))
    return tokens[len(prompt) :]


def assert_all_blocks_free_or_cached(scheduler: Scheduler) -> None:
    """The end state of every lifecycle test: nothing unfinished, no block used."""
    kv = scheduler.kv_manager
    assert not scheduler.has_unfinished_requests()
    kv.release_swap_in_sources()  # the runner has executed the last step
    scheduler.check_integrity()
    assert kv.device_pool.num_used_blocks == 0
    assert kv.num_free_blocks == kv.num_device_blocks
    if kv.swap_pool is not None:
        assert kv.swap_pool.num_used_blocks == 0
