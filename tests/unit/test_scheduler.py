"""Scheduler lifecycles driven by a fake runner over tiny pools (blocks of 4).

Every step goes through ``engine_fakes.step``, which checks the scheduler's
integrity (queues, ref counts == block tables, pools) after schedule and
after update; the fake runner checks every cached context it reads.
"""

from __future__ import annotations

import pytest

from cluster.shared.types import FinishReason
from workers.engine.outputs import ModelOutput
from workers.engine.sequence import SequenceStatus
from tests.unit.engine_fakes import (
    FakeRunner,
    assert_all_blocks_free_or_cached,
    expected_output,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)


def chunks(sched_out):
    """``[(request_id, num_input_tokens, num_sample_tokens), ...]`` of a step."""
    return [(r.request_id, r.num_input_tokens, r.num_sample_tokens) for r in sched_out.scheduled]


def test_single_request_lifecycle():
    sched = make_scheduler(8, 0)
    runner = FakeRunner.for_scheduler(sched)
    a = make_request("a", 6, max_tokens=3)
    sched.add_request(a)
    out, results = step(sched, runner)
    (req,) = out.scheduled
    assert (req.input_token_ids, req.num_computed_tokens, req.block_ids, req.num_sample_tokens) == (
        list(range(100, 106)), 0, [0, 1], 1,
    )
    assert results == [(a, a.output_token_ids[:1], None)]
    out, _ = step(sched, runner)
    assert out.scheduled[0].input_token_ids == a.output_token_ids[:1]
    assert out.scheduled[0].num_computed_tokens == 6
    _, results = step(sched, runner)
    assert a.status is SequenceStatus.FINISHED and a.finish_reason is FinishReason.LENGTH
    assert results[0][0] is a and a.output_token_ids == expected_output(range(100, 106), 3)
    final = sched.schedule()
    assert final.is_empty and final.finished_request_ids == {"a"}
    sched.update_from_output(final, ModelOutput([], []))
    assert_all_blocks_free_or_cached(sched)
    assert sched.kv_manager.num_cached_blocks == 2  # KV of 8 of the 9 tokens was computed


def test_prefix_hit_shares_blocks_while_both_run():
    sched = make_scheduler(16, 0)
    runner = FakeRunner.for_scheduler(sched)
    a = make_request("a", 10, max_tokens=5)
    sched.add_request(a)
    step(sched, runner)  # a's prompt computed: blocks 0, 1 cached
    b_prompt = list(range(100, 109)) + [7, 7, 7]
    b = make_request("b", b_prompt, max_tokens=3)
    sched.add_request(b)
    out, _ = step(sched, runner)
    b_req = out.scheduled[1]
    assert (b_req.request_id, b_req.num_computed_tokens, b_req.input_token_ids) == ("b", 8, [108, 7, 7, 7])
    assert b_req.block_ids == [0, 1, 3]
    assert b.num_cached_tokens == 8 and a.num_cached_tokens == 0
    pool = sched.kv_manager.device_pool
    assert [pool.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    finished = run_to_completion(sched, runner)
    assert finished["a"].output_token_ids == expected_output(range(100, 110), 5)
    assert finished["b"].output_token_ids == expected_output(b_prompt, 3)
    assert_all_blocks_free_or_cached(sched)


def test_lru_eviction_keeps_the_head_of_a_finished_prompt():
    sched = make_scheduler(8, 0)
    runner = FakeRunner.for_scheduler(sched)
    sched.add_request(make_request("a", 12, max_tokens=1))
    run_to_completion(sched, runner)  # blocks 0, 1, 2 cached and free; 3..7 empty
    assert sched.kv_manager.device_pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    sched.add_request(make_request("b", list(range(500, 520)), max_tokens=1))
    sched.add_request(make_request("c", [900, 901, 902], max_tokens=1))
    out, _ = step(sched, runner)
    assert [r.block_ids for r in out.scheduled] == [[3, 4, 5, 6, 7], [2]]  # a's tail evicted first
    hits, num_hit = sched.kv_manager.get_computed_blocks(make_request("again", 12))
    assert (hits, num_hit) == ([0, 1], 8)
    run_to_completion(sched, runner)
    assert_all_blocks_free_or_cached(sched)


@pytest.mark.parametrize(
    "budget, expected",
    [
        (16, [[("a", 16, 0)], [("a", 16, 0)], [("a", 8, 1)]]),  # alone
        (17, [[("d", 1, 1), ("p", 16, 0)], [("d", 1, 1), ("p", 16, 0)], [("d", 1, 1), ("p", 8, 1)]]),
        (16, [[("d", 1, 1), ("p", 15, 0)], [("d", 1, 1), ("p", 15, 0)], [("d", 1, 1), ("p", 10, 1)]]),
    ],
)
def test_chunked_prefill_splits_a_40_token_prompt(budget, expected):
    sched = make_scheduler(32, 0, max_num_batched_tokens=budget)
    runner = FakeRunner.for_scheduler(sched)
    prompt = list(range(300, 340))
    with_decode = expected[0][0][0] == "d"
    if with_decode:
        sched.add_request(make_request("d", 4, max_tokens=10))
        step(sched, runner)  # d is decoding from now on
    sched.add_request(make_request("p" if with_decode else "a", prompt, max_tokens=2))
    got = [chunks(step(sched, runner)[0]) for _ in range(3)]
    assert got == expected
    finished = run_to_completion(sched, runner)
    assert finished["p" if with_decode else "a"].output_token_ids == expected_output(prompt, 2)
    assert_all_blocks_free_or_cached(sched)


def test_without_chunking_a_prompt_waits_to_be_admitted_whole():
    sched = make_scheduler(32, 0, max_num_batched_tokens=16, enable_chunked_prefill=False)
    runner = FakeRunner.for_scheduler(sched)
    sched.add_request(make_request("d", 4, max_tokens=3))
    step(sched, runner)
    sched.add_request(make_request("p", list(range(300, 316)), max_tokens=1))  # 16 > 15 left
    sched.add_request(make_request("q", [1, 2], max_tokens=1))  # may not overtake p
    assert chunks(step(sched, runner)[0]) == [("d", 1, 1)]
    assert chunks(step(sched, runner)[0]) == [("d", 1, 1)]  # d finishes here
    assert chunks(step(sched, runner)[0]) == [("p", 16, 1)]
    assert chunks(step(sched, runner)[0]) == [("q", 2, 1)]
    assert_all_blocks_free_or_cached(sched)
    assert "enable_chunked_prefill" in sched.check_request_fits(17, 1)


def run_pressured(preemption_mode: str, num_blocks: int, num_cpu_blocks: int, **kwargs):
    """Four requests that cannot all hold their KV at once."""
    sched = make_scheduler(num_blocks, num_cpu_blocks, preemption_mode=preemption_mode, **kwargs)
    runner = FakeRunner.for_scheduler(sched)
    prompts = {f"r{i}": [10 * i + j for j in range(6 + i)] for i in range(4)}
    for i, (rid, prompt) in enumerate(prompts.items()):
        sched.add_request(make_request(rid, prompt, max_tokens=10, arrival_time=float(i)))
    finished = run_to_completion(sched, runner)
    assert_all_blocks_free_or_cached(sched)
    return sched, runner, {rid: seq.output_token_ids for rid, seq in finished.items()}, prompts


def test_preemption_by_swap_matches_an_unpressured_run():
    _, _, calm, prompts = run_pressured("swap", 64, 0)
    sched, runner, outputs, _ = run_pressured("swap", 8, 16)
    assert outputs == calm == {rid: expected_output(p, 10) for rid, p in prompts.items()}
    assert sched.num_preemptions_total > 0
    assert any(s.swap_out for s in runner.steps) and any(s.swap_in for s in runner.steps)


def recomputed(runner, prompts):
    """Scheduled chunks that re-enter a preempted sequence's prompt + output."""
    return [
        r for s in runner.steps for r in s.scheduled
        if r.num_input_tokens > 1 and r.seq_len > len(prompts[r.request_id])
    ]


def test_preemption_by_recompute_matches_and_reuses_the_cache():
    _, _, calm, _ = run_pressured("recompute", 64, 0)
    sched, runner, outputs, prompts = run_pressured("recompute", 8, 0)
    assert outputs == calm
    assert sched.num_preemptions_total > 0
    assert not any(s.swap_out or s.swap_in for s in runner.steps)
    # A recomputed sequence re-enters with prompt + output in one chunk, after
    # its cached prefix when LRU eviction has not taken it yet (r3 here; r2's
    # blocks were evicted while it waited).
    resumed = recomputed(runner, prompts)
    assert [(r.request_id, r.num_computed_tokens, r.num_input_tokens) for r in resumed] == [
        ("r2", 0, 11), ("r3", 12, 3),
    ]
    assert all(r.num_sample_tokens == 1 for r in resumed)


def test_swap_falls_back_to_recompute_when_swap_space_is_full():
    _, _, calm, _ = run_pressured("swap", 64, 0)
    sched, runner, outputs, prompts = run_pressured("swap", 8, 3)  # room for one victim only
    assert outputs == calm and sched.num_preemptions_total == 2
    assert any(s.swap_out for s in runner.steps) and recomputed(runner, prompts)
    _, _, no_swap, _ = run_pressured("swap", 8, 0)  # no swap pool at all
    assert no_swap == calm


def test_priority_orders_admission_then_arrival():
    sched = make_scheduler(16, 0, max_num_seqs=1)
    runner = FakeRunner.for_scheduler(sched)
    sched.add_request(make_request("late-low", 3, max_tokens=1, priority=1, arrival_time=0.0))
    sched.add_request(make_request("b", 3, max_tokens=1, priority=0, arrival_time=2.0))
    sched.add_request(make_request("a", 3, max_tokens=1, priority=0, arrival_time=1.0))
    order = [step(sched, runner)[0].scheduled[0].request_id for _ in range(3)]
    assert order == ["a", "b", "late-low"]
    assert_all_blocks_free_or_cached(sched)


def test_preemption_victim_is_the_lowest_priority_sequence():
    sched = make_scheduler(6, 0, preemption_mode="recompute", enable_caching=False)
    runner = FakeRunner.for_scheduler(sched)
    low = make_request("low", 8, max_tokens=12, priority=5, arrival_time=0.0)
    high = make_request("high", list(range(200, 208)), max_tokens=12, priority=0, arrival_time=1.0)
    sched.add_request(low)
    sched.add_request(high)
    while low.num_preemptions == 0:
        step(sched, runner)
        assert high.num_preemptions == 0
    assert low.status is SequenceStatus.WAITING and low.output_token_ids  # its tokens are kept
    finished = run_to_completion(sched, runner)
    assert finished["low"].output_token_ids == expected_output(range(100, 108), 12)
    assert_all_blocks_free_or_cached(sched)


def test_aborts_at_every_state():
    sched = make_scheduler(8, 8, max_num_batched_tokens=8)
    runner = FakeRunner.for_scheduler(sched)
    waiting = make_request("waiting", 4)
    sched.add_request(waiting)
    assert sched.abort_request("waiting") and waiting.finish_reason is FinishReason.ABORT
    assert not sched.abort_request("waiting") and not sched.abort_request("unknown")

    prefill = make_request("prefill", 20)
    sched.add_request(prefill)
    out, _ = step(sched, runner)  # 8 of 20 tokens computed
    assert out.finished_request_ids == {"waiting"}
    assert sched.abort_request("prefill") and prefill.block_ids == []
    sched.check_integrity()

    decode = make_request("decode", 4, max_tokens=20)
    sched.add_request(decode)
    out, _ = step(sched, runner)
    assert out.finished_request_ids == {"prefill"}
    step(sched, runner)
    assert sched.abort_request("decode")
    out, _ = step(sched, runner)
    assert out.finished_request_ids == {"decode"} and out.is_empty
    assert_all_blocks_free_or_cached(sched)


def test_abort_of_a_swapped_sequence_frees_its_cpu_blocks():
    sched = make_scheduler(4, 8)
    runner = FakeRunner.for_scheduler(sched)
    first = make_request("first", 6, max_tokens=20, arrival_time=0.0)
    second = make_request("second", list(range(50, 56)), max_tokens=20, arrival_time=1.0)
    sched.add_request(first)
    sched.add_request(second)
    while second.status is not SequenceStatus.SWAPPED:
        step(sched, runner)
    assert second.cpu_block_ids and sched.num_swapped == 1
    assert sched.abort_request("second") and second.cpu_block_ids == []
    sched.check_integrity()
    run_to_completion(sched, runner)
    assert_all_blocks_free_or_cached(sched)


def test_abort_while_the_step_runs_is_skipped_by_update():
    sched = make_scheduler(8, 0)
    runner = FakeRunner.for_scheduler(sched)
    sched.add_request(make_request("a", 5))
    sched.add_request(make_request("b", list(range(200, 205))))
    out = sched.schedule()
    model_out = runner.execute(out)
    assert sched.abort_request("a")
    results = sched.update_from_output(out, model_out)
    assert [seq.request_id for seq, _, _ in results] == ["b"]
    sched.check_integrity()


def test_token_level_stops():
    eos = 5
    sched = make_scheduler(16, 0, eos_token_ids=[eos], max_model_len=8)
    runner = FakeRunner.for_scheduler(sched, model=lambda ids: eos)
    sched.add_request(make_request("eos", 3, max_tokens=4))
    sched.add_request(make_request("ignore", 3, max_tokens=4, ignore_eos=True))
    sched.add_request(make_request("stop-id", 3, max_tokens=4, ignore_eos=True, stop_token_ids=[eos]))
    sched.add_request(make_request("model-len", 6, max_tokens=4, ignore_eos=True))
    done = run_to_completion(sched, runner)
    assert (done["eos"].finish_reason, done["eos"].output_token_ids) == (FinishReason.STOP, [eos])
    assert (done["ignore"].finish_reason, done["ignore"].num_output_tokens) == (FinishReason.LENGTH, 4)
    assert (done["stop-id"].finish_reason, done["stop-id"].num_output_tokens) == (FinishReason.STOP, 1)
    assert (done["model-len"].finish_reason, done["model-len"].num_tokens) == (FinishReason.LENGTH, 8)
    assert_all_blocks_free_or_cached(sched)


def test_finish_request_for_a_stop_string():
    sched = make_scheduler(8, 0)
    runner = FakeRunner.for_scheduler(sched)
    a = make_request("a", 4, max_tokens=10)
    sched.add_request(a)
    step(sched, runner)
    assert sched.finish_request("a", FinishReason.STOP) and a.finish_reason is FinishReason.STOP
    assert not sched.has_unfinished_requests()
    assert_all_blocks_free_or_cached(sched)


def test_a_sequence_that_outgrows_the_pool_ends_instead_of_looping():
    sched = make_scheduler(4, 4)  # 16 tokens of KV in all
    runner = FakeRunner.for_scheduler(sched)
    assert "lower max_tokens" in sched.check_request_fits(10, 20)
    grower = make_request("grower", 10, max_tokens=20)  # added without the check
    sched.add_request(grower)
    done = run_to_completion(sched, runner, max_steps=50)
    assert done["grower"].finish_reason is FinishReason.LENGTH
    assert done["grower"].num_tokens == 17 and "num_kv_blocks" in grower.finish_message
    assert_all_blocks_free_or_cached(sched)


def test_a_prompt_that_never_fits_is_aborted_without_blocking_others():
    sched = make_scheduler(4, 0)
    runner = FakeRunner.for_scheduler(sched)
    sched.add_request(make_request("huge", 17, arrival_time=0.0))
    sched.add_request(make_request("small", 4, max_tokens=2, arrival_time=1.0))
    out, results = step(sched, runner)
    assert chunks(out) == [("small", 4, 1)]
    huge = results[0][0]
    assert (huge.request_id, huge.finish_reason, results[0][1]) == ("huge", FinishReason.ABORT, [])
    assert "5 KV blocks" in huge.finish_message
    run_to_completion(sched, runner)
    assert_all_blocks_free_or_cached(sched)


def test_check_request_fits():
    sched = make_scheduler(8, 0, max_model_len=32)
    assert sched.check_request_fits(4, 16) is None
    assert sched.check_request_fits(8, 100) is None  # capped by max_model_len: 31 tokens of KV
    assert "empty" in sched.check_request_fits(0, 1)
    assert "at most 31 tokens" in sched.check_request_fits(32, 1)
    small = make_scheduler(4, 0, max_model_len=64)
    assert small.check_request_fits(10, 7) is None  # 16 tokens of KV
    assert "5 KV blocks" in small.check_request_fits(10, 8)


def test_max_num_seqs_caps_the_batch():
    sched = make_scheduler(16, 0, max_num_seqs=2)
    runner = FakeRunner.for_scheduler(sched)
    for rid in "abc":
        sched.add_request(make_request(rid, 3, max_tokens=2))
    assert [r.request_id for r in step(sched, runner)[0].scheduled] == ["a", "b"]
    assert sched.num_waiting == 1 and sched.num_running == 2
    run_to_completion(sched, runner)
    assert_all_blocks_free_or_cached(sched)


def test_duplicate_request_id_is_rejected():
    sched = make_scheduler(8, 0)
    sched.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="unique id"):
        sched.add_request(make_request("a", 3))


@pytest.mark.parametrize("chunk", [64, 8])
def test_a_request_waits_for_the_prefill_of_its_shared_prefix_instead_of_repeating_it(chunk):
    # Two requests with one 24-token prefix (6 blocks of 4) arrive together.
    sched = make_scheduler(32, 0, max_num_batched_tokens=chunk)
    runner = FakeRunner.for_scheduler(sched)
    prefix = list(range(300, 324))
    first, second = make_request("first", prefix + [1, 2]), make_request("second", prefix + [3, 4])
    sched.add_request(first)
    sched.add_request(second)
    steps_before_second = 0
    while second.status is SequenceStatus.WAITING:
        step(sched, runner)
        steps_before_second += 1
        assert first.status is SequenceStatus.RUNNING
    # It started once the prefix was computed, from the cache.
    # (the steps that computed the prefix, then the one that admitted it)
    assert steps_before_second == -(-len(prefix) // chunk) + 1 and second.num_cached_tokens == 24
    run_to_completion(sched, runner)
    assert_all_blocks_free_or_cached(sched)


def test_without_prefix_caching_nothing_waits():
    sched = make_scheduler(32, 0, enable_caching=False)
    runner = FakeRunner.for_scheduler(sched)
    prefix = list(range(300, 324))
    sched.add_request(make_request("first", prefix + [1]))
    sched.add_request(make_request("second", prefix + [2]))
    step(sched, runner)
    assert sched.num_running == 2 and sched.num_waiting == 0
