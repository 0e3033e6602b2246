"""A KV export pins its blocks while the holder's forward runs, not after its
step (workers/engine/pool_gate.py): the holder's forward is held until the
fetch has returned, which it can only do if the pin did not wait for that
step. And the gate itself: another thread runs only while it is lent."""

from __future__ import annotations

import asyncio
import queue
import random
import threading

from cluster.shared.types import GenerationRequest, SamplingParams
from tests.factories import make_tiny_model_dir
from workers.engine.async_engine import AsyncEngine
from workers.engine.pool_gate import PoolGate
from workers.kv_transfer import KVTransfer, LocalHolder
from workers.llm import LLM


class _Engine:
    forward_gate = None


def test_the_gate_lets_another_thread_in_only_while_lent():
    gate, engine, ran = PoolGate(), _Engine(), []
    gate.take(engine)
    assert engine.forward_gate is gate
    other = threading.Thread(target=lambda: gate.run(lambda: ran.append(1)))
    other.start()
    other.join(0.2)
    assert ran == [] and other.is_alive()  # held by the engine thread
    with gate.lent():
        other.join(10)
    assert ran == [1]
    inbox: "queue.Queue[int]" = queue.Queue()
    threading.Timer(0.1, lambda: inbox.put(7)).start()
    assert gate.get(inbox, block=True) == 7  # lent while waiting, held again after
    assert gate.run is not None and not gate._lock.acquire(blocking=False)
    gate.pause()  # nobody waits: the engine thread keeps the gate (and the GIL)
    waiter = threading.Thread(target=lambda: gate.run(lambda: ran.append(2)))
    waiter.start()
    while not gate._waiting:  # in run, blocked on the gate
        waiter.join(0.01)
    for _ in range(10_000):  # someone waits: each pause lends the gate a moment (as each empty step does)
        gate.pause()
        if len(ran) == 2:
            break
    waiter.join(10)
    assert ran == [1, 2] and not gate._lock.acquire(blocking=False)
    gate.give_back(engine)
    assert engine.forward_gate is None and gate.run(lambda: 5) == 5


def test_an_export_does_not_wait_for_the_holders_step(tmp_path):
    model_dir = make_tiny_model_dir("llama", tmp_path / "gate-llama")
    sides = []
    for _ in range(2):
        llm = LLM(str(model_dir), block_size=4, num_kv_blocks=64)
        front = AsyncEngine(llm.engine)
        front.start()
        sides.append((llm, front, KVTransfer(front, llm.runner)))
    (holder_llm, holder, holder_transfer), (_, receiver, receiver_transfer) = sides
    in_forward, release, hold = threading.Event(), threading.Event(), threading.Event()
    real_execute = holder_llm.runner.execute

    def held_execute(sched):
        if hold.is_set():
            in_forward.set()
            assert release.wait(60)
        return real_execute(sched)

    holder_llm.runner.execute = held_execute
    rng = random.Random(3)
    prompt = [rng.randrange(3, 500) for _ in range(27)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def run(front, request_id, ids):
        tokens = []
        async for out in front.generate(GenerationRequest(request_id, ids, params)):
            tokens += out.new_token_ids
        return tokens

    async def main():
        expected = await run(holder, "cold", prompt)
        hold.set()
        busy = asyncio.ensure_future(run(holder, "busy", [rng.randrange(3, 500) for _ in range(9)]))
        assert await asyncio.to_thread(in_forward.wait, 60)
        # The holder's forward is held until this fetch returns: a pin that waited for the step would not.
        imported = await asyncio.wait_for(receiver_transfer.fetch(LocalHolder(holder_transfer), prompt), 30)
        assert imported == 24 and not release.is_set()
        hold.clear()
        release.set()
        assert len(await busy) == 4
        assert await run(receiver, "fetched", prompt) == expected

        def check(transfer):
            return lambda engine: transfer.ledger.check_integrity(list(engine.scheduler.queue))

        await holder.call(check(holder_transfer))
        await receiver.call(check(receiver_transfer))
        assert not holder_transfer.ledger.holdings() and not receiver_transfer.ledger.holdings()

    try:
        asyncio.run(main())
    finally:
        release.set()
        holder.shutdown()
        receiver.shutdown()


def test_a_request_waiting_for_pinned_blocks_lets_their_release_in(tmp_path):
    # Every cached block pinned (a warm start's export of a small pool), then a request that
    # needs some of them: its steps schedule nothing. Those steps must lend the gate, or the
    # release (which needs it) never runs and the request waits for ever (seen in the suite:
    # a replica that joined warm-started from one whose whole pool was cached).
    model_dir = make_tiny_model_dir("llama", tmp_path / "pinned-llama")
    llm = LLM(str(model_dir), block_size=4, num_kv_blocks=16)
    front = AsyncEngine(llm.engine)
    front.start()
    transfer = KVTransfer(front, llm.runner)
    rng = random.Random(5)
    filler = [rng.randrange(3, 500) for _ in range(57)]  # 14 full blocks cached once it ends
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def run(request_id, ids):
        tokens = []
        async for out in front.generate(GenerationRequest(request_id, ids, params)):
            tokens += out.new_token_ids
        return tokens

    async def main():
        await run("filler", filler)
        hashes, _ = transfer.prefix_hashes(filler)
        held = await transfer._pool_call(lambda engine: transfer.ledger.pin_hottest(hashes, 64))
        assert held is not None and len(held.block_ids) >= 12
        waiting = asyncio.ensure_future(run("waiting", [rng.randrange(3, 500) for _ in range(20)]))
        await asyncio.sleep(0.5)
        assert not waiting.done()  # 6 blocks needed, at most 4 free: it waits for the pinned ones
        await asyncio.wait_for(transfer._pool_call(lambda engine: transfer.ledger.release(held.transfer_id)), 10)
        assert len(await asyncio.wait_for(waiting, 60)) == 4
        await front.call(lambda engine: transfer.ledger.check_integrity(list(engine.scheduler.queue)))

    try:
        asyncio.run(main())
    finally:
        front.shutdown()
