"""Sliding windows: blocks no layer's window reaches are released after each
step, so a sequence holds about a window's worth of blocks whatever its
length, outputs stay exact, and the pool ends intact."""

from __future__ import annotations

from tests.unit.engine_fakes import (
    FakeRunner,
    assert_all_blocks_free_or_cached,
    expected_output,
    make_kv_manager,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)

WINDOW = 8


def test_release_keeps_positions_and_points_released_entries_at_a_held_block():
    kv = make_kv_manager(num_blocks=8)
    seq = make_request("a", 18)
    kv.allocate_slots(seq, 18)
    seq.num_computed_tokens = 18
    table = list(seq.block_ids)
    # Next position 18 attends from 11: blocks 0 and 1 (positions 0..7) are out of reach.
    assert kv.release_outside_window(seq, WINDOW) == 2
    assert seq.block_ids == [table[2], table[2]] + table[2:] and seq.num_released_blocks == 2
    assert kv.device_pool.num_used_blocks == 3
    kv.check_integrity([seq])
    assert kv.release_outside_window(seq, WINDOW) == 0  # idempotent
    kv.free(seq)
    assert kv.device_pool.num_used_blocks == 0 and seq.num_released_blocks == 0


def test_a_sequence_longer_than_the_pool_runs_in_its_window():
    # 6 blocks of 4 tokens hold 24 tokens; the sequence grows to 60.
    scheduler = make_scheduler(num_blocks=6, num_cpu_blocks=0, sliding_window=WINDOW, preemption_mode="recompute")
    runner = FakeRunner.for_scheduler(scheduler)
    seq = make_request("long", 10, max_tokens=50)
    scheduler.add_request(seq)
    held = []
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)  # checks every context the window reads, and integrity
        held.append(scheduler.kv_manager.device_pool.num_used_blocks)
    assert seq.output_token_ids == expected_output(seq.prompt_token_ids, 50, window=WINDOW)
    assert max(held) <= 4  # about a window (8 tokens) plus the block being filled
    assert_all_blocks_free_or_cached(scheduler)


def test_preempted_windowed_sequences_are_recomputed_not_swapped():
    scheduler = make_scheduler(num_blocks=9, num_cpu_blocks=16, sliding_window=WINDOW, preemption_mode="swap",
                               max_num_batched_tokens=16)
    runner = FakeRunner.for_scheduler(scheduler)
    seqs = [make_request(f"r{i}", 6 + 3 * i, max_tokens=14) for i in range(4)]
    for seq in seqs:
        scheduler.add_request(seq)
    finished = run_to_completion(scheduler, runner)
    for seq in seqs:
        assert finished[seq.request_id].output_token_ids == expected_output(seq.prompt_token_ids, 14, window=WINDOW)
    assert scheduler.num_preemptions_total > 0
    assert_all_blocks_free_or_cached(scheduler)


def test_without_a_window_nothing_is_released():
    scheduler = make_scheduler(num_blocks=16)
    runner = FakeRunner.for_scheduler(scheduler)
    seq = make_request("a", 10, max_tokens=20)
    scheduler.add_request(seq)
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
        assert seq.num_released_blocks == 0
    assert seq.output_token_ids == expected_output(seq.prompt_token_ids, 20)
