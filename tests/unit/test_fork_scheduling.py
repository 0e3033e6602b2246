"""Parallel sampling in the scheduler and the KV manager (fake runner): a
request forks into its choices after its prefill, the choices share the
prompt's full blocks by reference and copy the partial last one, and every
preemption path keeps the sharing right. ``FakeRunner`` checks every cached
context against the true tokens before each step, and ``step`` checks the
block-table invariants after it."""

from __future__ import annotations

import dataclasses

import pytest

from tests.unit.engine_fakes import (FakeRunner, assert_all_blocks_free_or_cached, expected_output, fork_token,
                                     make_request, make_scheduler, next_token, run_to_completion, step)


def forked(request_id: str, prompt, n: int, max_tokens: int = 6, **params):
    """A waiting sequence with ``n`` choices (as the engine builds it)."""
    seq = make_request(request_id, prompt, max_tokens=max_tokens, **params)
    seq.pending_forks = [(f"{request_id}#n{i}", dataclasses.replace(seq.sampling_params), None) for i in range(1, n)]
    return seq


def expected_choices(prompt, n: int, max_tokens: int) -> list[list[int]]:
    """Choice i: its own first token (``fork_token``), then the fake model's continuation."""
    out = []
    for i in range(n):
        first = next_token(prompt) if i == 0 else fork_token(prompt, i)
        out.append([first] + expected_output(list(prompt) + [first], max_tokens - 1))
    return out


def outputs(finished: dict, request_id: str, n: int) -> list[list[int]]:
    ids = [request_id] + [f"{request_id}#n{i}" for i in range(1, n)]
    return [finished[i].output_token_ids for i in ids]


@pytest.mark.parametrize("prompt_len", [8, 10])  # whole blocks only, and a partial last block
def test_choices_share_the_prompt_blocks_and_copy_the_partial_one(prompt_len):
    sched = make_scheduler(num_blocks=16, num_cpu_blocks=0)
    runner = FakeRunner.for_scheduler(sched)
    prompt = list(range(100, 100 + prompt_len))
    sched.add_request(forked("r", prompt, 3))
    step(sched, runner)  # the prefill, which forks
    seqs = {s.request_id: s for s in sched.queue.running}
    assert set(seqs) == {"r", "r#n1", "r#n2"}
    full = prompt_len // 4
    parent = seqs["r"].block_ids
    for child in ("r#n1", "r#n2"):
        assert seqs[child].block_ids[:full] == parent[:full]  # shared, not copied
        assert len(seqs[child].block_ids) == len(parent)
    pool = sched.kv_manager.device_pool
    assert [pool.ref_count(b) for b in parent[:full]] == [3] * full
    partial = 1 if prompt_len % 4 else 0
    assert pool.num_used_blocks == len(parent) + 2 * partial  # one prompt, plus each choice's copied block
    finished = run_to_completion(sched, runner)
    assert outputs(finished, "r", 3) == expected_choices(prompt, 3, 6)
    assert_all_blocks_free_or_cached(sched)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("caching", [True, False])
def test_preempting_forked_groups_changes_no_token(mode, caching):
    sched = make_scheduler(num_blocks=14, num_cpu_blocks=32, preemption_mode=mode, enable_caching=caching,
                           max_num_batched_tokens=16)
    runner = FakeRunner.for_scheduler(sched)
    prompts = [list(range(10 * k, 10 * k + 9)) for k in range(1, 4)]
    for k, prompt in enumerate(prompts):
        sched.add_request(forked(f"r{k}", prompt, 3, max_tokens=10))
    finished = run_to_completion(sched, runner)
    assert sched.num_preemptions_total > 0
    for k, prompt in enumerate(prompts):
        assert outputs(finished, f"r{k}", 3) == expected_choices(prompt, 3, 10)
    assert_all_blocks_free_or_cached(sched)


def test_a_choice_without_a_free_block_is_recomputed():
    # 9-token prompt: 2 full blocks and a partial one; 3 blocks in all, so no block is
    # left to copy the partial one into: the choice waits and is recomputed.
    sched = make_scheduler(num_blocks=4, num_cpu_blocks=0, preemption_mode="recompute")
    runner = FakeRunner.for_scheduler(sched)
    prompt = list(range(50, 59))
    sched.add_request(forked("r", prompt, 3, max_tokens=3))
    step(sched, runner)
    assert {s.request_id for s in sched.queue.waiting} == {"r#n2"}  # one copy fit, the other waits
    assert sched.queue.get("r#n2").output_token_ids == [fork_token(prompt, 2)]
    finished = run_to_completion(sched, runner)
    assert outputs(finished, "r", 3) == expected_choices(prompt, 3, 3)
    assert_all_blocks_free_or_cached(sched)


def test_a_choice_that_ends_on_its_first_token_holds_no_block():
    sched = make_scheduler(num_blocks=8, num_cpu_blocks=0)
    runner = FakeRunner.for_scheduler(sched)
    prompt = list(range(20, 30))
    stop = fork_token(prompt, 1)
    sched.add_request(forked("r", prompt, 3, max_tokens=4, stop_token_ids=(stop,)))
    _, results = step(sched, runner)
    ended = [seq for seq, _, _ in results if seq.request_id == "r#n1"]
    assert ended and ended[0].is_finished and not ended[0].block_ids
    assert {s.request_id for s in sched.queue.running} == {"r", "r#n2"}
    run_to_completion(sched, runner)
    assert_all_blocks_free_or_cached(sched)


def test_every_choice_takes_a_slot_of_max_num_seqs_from_admission():
    sched = make_scheduler(num_blocks=32, num_cpu_blocks=0, max_num_seqs=4)
    runner = FakeRunner.for_scheduler(sched)
    sched.add_request(forked("a", list(range(10, 18)), 3))
    sched.add_request(make_request("b", list(range(20, 28))))
    sched.add_request(make_request("c", list(range(30, 38))))
    out, _ = step(sched, runner)
    assert [r.request_id for r in out.scheduled] == ["a", "b"]  # a holds 3 slots, b the fourth
    for _ in range(30):
        if not sched.has_unfinished_requests():
            break
        step(sched, runner)
        assert sched.num_running <= 4
    assert_all_blocks_free_or_cached(sched)


def test_fork_events_register_each_block_once():
    sched = make_scheduler(num_blocks=16, num_cpu_blocks=0)
    runner = FakeRunner.for_scheduler(sched)
    sched.add_request(forked("r", list(range(100, 110)), 2, max_tokens=8))
    run_to_completion(sched, runner)
    batch = sched.kv_manager.take_events()
    stored = [h for e in batch.events if type(e).__name__ == "BlockStored" for h in e.block_hashes]
    assert len(stored) == len(set(stored))  # the shared prompt blocks were stored once
    assert_all_blocks_free_or_cached(sched)
