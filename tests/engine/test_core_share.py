"""Replicas sharing a machine's cores by who is busy (``workers/core_share.py``):
the board's arithmetic, a dead replica's mark, and outputs that do not
depend on the threads a step ran on."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch

from cluster.shared.config import EngineConfig
from cluster.shared.types import GenerationRequest, SamplingParams
from workers.core_share import SIZE, CoreShare
from workers.engine.async_engine import AsyncEngine


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


class Recorder:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, n: int) -> None:
        self.calls.append(n)


def test_one_busy_replica_takes_every_core_and_two_share_them(tmp_path):
    path = str(tmp_path / "board")
    a_threads, b_threads = Recorder(), Recorder()
    a = CoreShare(path, 4, a_threads)
    b = CoreShare(path, 4, b_threads, pid=_live_other_pid())
    assert a.slot != b.slot
    a.before_step()
    assert a.threads == 4  # alone: all four
    b.before_step()
    assert b.threads == 2  # both busy: two each
    a.before_step()
    assert a.threads == 2
    b.idle()
    a.before_step()
    assert a.threads == 4 and a_threads.calls == [4, 2, 4]  # set only when it changes
    a.close(), b.close()


def test_threads_are_at_least_one_and_at_most_the_replicas_cap(tmp_path):
    path = str(tmp_path / "board")
    a = CoreShare(path, 2, Recorder(), max_threads=1)
    assert a.threads_for(1) == 1 and a.threads_for(5) == 1
    b = CoreShare(str(tmp_path / "other"), 3, Recorder())
    assert (b.threads_for(1), b.threads_for(2), b.threads_for(3), b.threads_for(7)) == (3, 1, 1, 1)
    a.close(), b.close()


def test_a_dead_replicas_busy_mark_is_cleared_and_its_slot_reused(tmp_path):
    path = str(tmp_path / "board")
    dead = CoreShare(path, 2, Recorder(), pid=_dead_pid())
    dead.before_step()  # killed mid-step: its mark stays on the board
    dead._map.close()
    dead._map = None
    live = CoreShare(path, 2, Recorder())
    assert live.slot == dead.slot  # the dead process's slot is taken back
    assert live.busy_replicas() == 0
    live.before_step()
    assert live.threads == 2
    live.close()


def test_every_slot_held_by_a_live_process_is_an_error(tmp_path):
    path = str(tmp_path / "board")
    held = [CoreShare(path, 2, Recorder(), pid=_live_other_pid()) for _ in range(SIZE // 16)]
    with pytest.raises(RuntimeError, match="already share"):
        CoreShare(path, 2, Recorder())
    for share in held:
        share.close()


def _live_other_pid() -> int:
    import os

    return os.getppid()


def test_outputs_do_not_depend_on_the_threads_each_step_ran_on():
    """The default model (shapes where the kernels do split over threads):
    greedy tokens and their logprobs with 2 threads throughout, and with the
    thread count changed before every step (1, 2, 1, ...), are identical."""
    from workers.builder import build_engine

    config = EngineConfig.from_kwargs(block_size=16, max_num_seqs=4)
    prompts = [[1, 504, 3287, 314, 260, 1789, 282, 4649, 30] * 3, list(range(200, 240))]
    saved = torch.get_num_threads()

    def run(before_step) -> list[tuple[list[int], list[float]]]:
        def build():
            torch.set_num_threads(2)
            return build_engine(config).engine

        front = AsyncEngine.on_own_thread(build, before_step=before_step)

        async def one(i: int, prompt: list[int]):
            tokens, logprobs = [], []
            params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
            async for out in front.generate(GenerationRequest(f"r{i}", prompt, params)):
                tokens += out.new_token_ids
                logprobs += [lp.logprob for lp in out.new_logprobs or []]
            return tokens, logprobs

        async def main():
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

        try:
            return asyncio.run(main())
        finally:
            front.shutdown()

    counts = iter(range(10**6))
    try:
        fixed = run(None)
        switching = run(lambda: torch.set_num_threads(1 + next(counts) % 2))
    finally:
        torch.set_num_threads(saved)
    assert next(counts) >= 10  # the thread count did change between steps
    assert [t for t, _ in switching] == [t for t, _ in fixed]
    assert [lp for _, lp in switching] == [lp for _, lp in fixed]
    assert all(len(t) == 12 for t, _ in fixed)
