"""Seeded random traffic over a tiny pool: arrivals with shared prefixes,
priorities, aborts, stop-string finishes and cache resets, under every
preemption / chunking / caching setting.

After every step: scheduler integrity (ref counts == block tables), the fake
runner's KV check, the step limits, and a mirror of the cached hashes built
only from KV events equals the pool's hash map. At the end every request has
ended, every output is what an unpressured run produces, and no block is used.
"""

from __future__ import annotations

import itertools
import random

import pytest

from cluster.shared.types import FinishReason
from workers.engine.block_pool import AllBlocksCleared, BlockRemoved, BlockStored
from tests.unit.engine_fakes import (
    next_token,
    VOCAB,
    FakeRunner,
    assert_all_blocks_free_or_cached,
    echo_token,
    expected_output,
    fixed_speculator,
    make_request,
    make_scheduler,
    step,
)

EOS = 7
BUDGET = 16
MAX_SEQS = 4


class EventMirror:
    """What a directory learns from KV events alone."""

    def __init__(self) -> None:
        self.hashes: set[bytes] = set()
        self.seq_no = 0

    def apply(self, kv) -> None:
        batch = kv.take_events()
        if batch is None:
            return
        assert batch.seq_no == self.seq_no + 1, "gap in KV event batches"
        self.seq_no = batch.seq_no
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert self.hashes.isdisjoint(event.block_hashes)
                self.hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert self.hashes.issuperset(event.block_hashes)
                self.hashes.difference_update(event.block_hashes)
            else:
                assert isinstance(event, AllBlocksCleared)
                self.hashes.clear()

    def resync(self, kv) -> None:
        snapshot = kv.take_snapshot()
        self.hashes, self.seq_no = set(snapshot.block_hashes), snapshot.seq_no


def random_prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    head = rng.choice(prefixes)[: rng.randrange(0, 9)]
    return head + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 13))]


def check_step_limits(sched_out) -> None:
    assert sched_out.num_batched_tokens <= BUDGET
    assert len(sched_out.scheduled) <= MAX_SEQS
    assert len({r.request_id for r in sched_out.scheduled}) == len(sched_out.scheduled)


CONFIGS = list(itertools.product(["swap", "recompute"], [True, False], [True, False]))


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("preemption_mode, chunked, caching", CONFIGS)
def test_random_traffic_keeps_every_invariant(preemption_mode, chunked, caching, speculate):
    """With ``speculate``, a model that often repeats itself and n-gram
    proposals: rejected slots, rollbacks and stops inside accepted drafts
    under the same traffic."""
    rng = random.Random(CONFIGS.index((preemption_mode, chunked, caching)))
    model = echo_token if speculate else next_token
    sched = make_scheduler(
        12, 6, max_num_seqs=MAX_SEQS, max_num_batched_tokens=BUDGET, enable_chunked_prefill=chunked,
        preemption_mode=preemption_mode, enable_caching=caching, max_model_len=32, eos_token_ids=[EOS],
        speculator=fixed_speculator() if speculate else None,
    )
    runner = FakeRunner.for_scheduler(sched, model)
    kv = sched.kv_manager
    mirror = EventMirror()
    prefixes = [[rng.randrange(VOCAB) for _ in range(8)] for _ in range(3)]
    prompts: dict[str, list[int]] = {}
    ended = {}
    for t in itertools.count():
        if t < 300 and rng.random() < 0.4:
            rid, prompt, max_tokens = f"r{t}", random_prompt(rng, prefixes), rng.randrange(1, 16)
            if sched.check_request_fits(len(prompt), max_tokens) is None:  # as the engine validates
                prompts[rid] = prompt
                sched.add_request(make_request(
                    rid, prompt, max_tokens=max_tokens, priority=rng.choice([0, 0, 1, 2]), arrival_time=float(t)
                ))
            else:
                assert not chunked and len(prompt) > BUDGET
        unfinished = sorted(set(prompts) - set(ended))
        if unfinished and rng.random() < 0.06:
            rid = rng.choice(unfinished)
            seq = sched.get_request(rid)
            reason = rng.choice([FinishReason.ABORT, FinishReason.STOP])  # abort or a stop string
            assert sched.finish_request(rid, reason)
            ended[rid] = seq
        if t >= 300 and not sched.has_unfinished_requests():
            break
        assert t < 2000, "traffic did not drain"
        sched_out, results = step(sched, runner)
        check_step_limits(sched_out)
        for seq, new_ids, _ in results:
            assert new_ids or seq.is_finished
            if seq.is_finished:
                ended[seq.request_id] = seq
        mirror.apply(kv)
        assert mirror.hashes == set(kv.device_pool.cached_block_hashes())
        if rng.random() < 0.02:
            mirror.resync(kv)
        if kv.device_pool.num_used_blocks == 0 and rng.random() < 0.3:
            assert kv.reset_prefix_cache()

    assert set(ended) == set(prompts)
    for rid, seq in ended.items():
        assert seq.finish_message is None, seq.finish_message
        assert seq.output_token_ids == expected_output(prompts[rid], seq.num_output_tokens, model)
        if seq.finish_reason is FinishReason.LENGTH:
            assert seq.num_output_tokens == seq.sampling_params.max_tokens or seq.num_tokens == 32
    stopped_by_eos = [s for s in ended.values() if s.output_token_ids[-1:] == [EOS]]
    assert all(s.finish_reason is FinishReason.STOP for s in stopped_by_eos)
    assert sched.num_preemptions_total > 0
    if speculate:  # proposals were made, some accepted and some rejected
        stats = sched.speculator.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_all_blocks_free_or_cached(sched)
    mirror.apply(kv)
    assert mirror.hashes == set(kv.device_pool.cached_block_hashes())
