"""Admission control and defensive validation, without Ray: the replica's
bounded queue (``AsyncEngine``, ``max_waiting_requests``), the engine
re-validating what crossed a process boundary, and the router's in-flight
cap and overload mapping (``RouterBackend``)."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from cluster.shared.config import SchedulerConfig
from cluster.shared.types import GenerationRequest, ReplicaOverloadedError, SamplingParams, StreamChunk
from router.backend import ModelInfo, RouterBackend
from router.errors import OverloadedError
from tests.unit.engine_fakes import FINGERPRINT, VOCAB, FakeRunner, make_scheduler
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import LLMEngine


def make_engine(max_num_seqs: int = 2) -> LLMEngine:
    scheduler = make_scheduler(32, 0, max_num_seqs=max_num_seqs, max_model_len=256)
    return LLMEngine(scheduler, FakeRunner.for_scheduler(scheduler), None, vocab_size=VOCAB, max_model_len=256,
                     model_fingerprint=FINGERPRINT)


def req(rid: str, max_tokens: int = 20, **params) -> GenerationRequest:
    return GenerationRequest(rid, [5, 6, 7, 8, 9], SamplingParams(max_tokens=max_tokens, temperature=0, **params))


async def drain(stream) -> list:
    return [out async for out in stream]


def used_blocks(front: AsyncEngine) -> int:
    async def read():
        return await front.call(lambda engine: engine.scheduler.kv_manager.device_pool.num_used_blocks)

    return asyncio.run(read())


def test_max_waiting_requests_validation():
    assert SchedulerConfig().max_waiting_requests == 256
    assert SchedulerConfig(max_waiting_requests=None).max_waiting_requests is None
    with pytest.raises(ValueError, match="max_waiting_requests must be >= 0"):
        SchedulerConfig(max_waiting_requests=-1)


def test_replica_rejects_past_its_bound_at_once_and_admits_again_when_one_ends():
    front = AsyncEngine(make_engine(max_num_seqs=2), max_waiting_requests=1)  # at most 2 + 1 unfinished
    front.start()

    async def main():
        streams = [front.generate(req(f"r{i}")) for i in range(3)]
        firsts = [await anext(s) for s in streams]  # admitted: each has produced output
        assert front.num_unfinished == 3
        with pytest.raises(ReplicaOverloadedError, match="max_num_seqs 2 \\+ max_waiting_requests 1") as info:
            await anext(front.generate(req("r3")))
        assert info.value.retry_after_s > 0
        assert front.num_unfinished == 3  # the rejected request left nothing behind
        outs = await drain(streams[0])
        assert (firsts[0].finished or outs[-1].finished)
        late = await drain(front.generate(req("r4")))  # a slot is free again
        assert late[-1].finished
        for s in streams[1:]:
            await drain(s)
        assert front.num_unfinished == 0

    try:
        asyncio.run(main())
        assert used_blocks(front) == 0
    finally:
        front.shutdown()


def test_unbounded_by_default_in_the_async_front():
    front = AsyncEngine(make_engine(max_num_seqs=1))
    front.start()

    async def main():
        results = await asyncio.gather(*(drain(front.generate(req(f"u{i}", 3))) for i in range(6)))
        assert all(r[-1].finished for r in results)

    try:
        asyncio.run(main())
    finally:
        front.shutdown()


def tampered(**fields) -> SamplingParams:
    """SamplingParams as if unpickled from a peer that skipped validation."""
    params = pickle.loads(pickle.dumps(SamplingParams()))
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


@pytest.mark.parametrize("request_, message", [
    (GenerationRequest("t", [5, 6], tampered(top_p=5.0)), "top_p must be in"),
    (GenerationRequest("t", [5, 6], tampered(temperature="hot")), "sampling_params has a value of the wrong type"),
    (GenerationRequest("t", [5, 6], tampered(stop=("",) * 100)), "at most 64 stop strings"),
    (GenerationRequest("t", [5, 6], tampered(logprobs=10**6)), "logprobs must be in"),
    (GenerationRequest("t", [5, 6], tampered(max_tokens=0)), "max_tokens must be an integer >= 1"),
    (GenerationRequest("t", "abc", SamplingParams()), "prompt_token_ids must be a list"),
    (GenerationRequest("t", 7, SamplingParams()), "prompt_token_ids must be a list"),
    (GenerationRequest("t", [5, -1], SamplingParams()), "outside the vocabulary"),
    (GenerationRequest("", [5], SamplingParams()), "request_id must be a non-empty string"),
    (GenerationRequest("t", [5], {"max_tokens": 3}), "sampling_params must be SamplingParams"),
    (GenerationRequest("t", [5], SamplingParams(), priority="high"), "priority must be an integer"),
])
def test_the_replica_revalidates_and_keeps_running(request_, message):
    front = AsyncEngine(make_engine())
    front.start()

    async def main():
        with pytest.raises(ValueError, match=message):
            await drain(front.generate(request_))
        return await drain(front.generate(req("ok", 3)))  # the engine loop is alive

    try:
        outs = asyncio.run(main())
        assert outs[-1].finished and front.error is None
        assert used_blocks(front) == 0
    finally:
        front.shutdown()


# ------------------------------------------------------------------ router
class FakeResponse:
    def __init__(self, chunks, error=None, gate=None):
        self.chunks, self.error, self.gate, self.cancelled = chunks, error, gate, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for chunk in self.chunks:
            if self.gate is not None:
                await self.gate.wait()
            yield chunk
        if self.error is not None:
            raise self.error

    def cancel(self):
        self.cancelled = True


class FakeHandle:
    def __init__(self, make_response):
        self.make_response = make_response

    def options(self, **_):
        return self

    def remote(self, request):
        return self.make_response(request)


class TaskError(Exception):
    """Like Ray's RayTaskError: the replica's exception is ``cause``."""

    def __init__(self, cause):
        super().__init__(str(cause))
        self.cause = cause


def chunk(rid: str) -> StreamChunk:
    return StreamChunk(rid, [1], "x")


def test_router_caps_inflight_requests():
    async def main():
        gate = asyncio.Event()
        backend = RouterBackend(FakeHandle(lambda r: FakeResponse([chunk(r.request_id)], gate=gate)), None,
                                ModelInfo("m", 64), max_inflight_requests=2)
        held = [backend.stream(req(f"h{i}")) for i in range(2)]
        tasks = [asyncio.ensure_future(anext(s)) for s in held]
        await asyncio.sleep(0)
        assert backend.num_inflight == 2
        with pytest.raises(OverloadedError, match="max_inflight_requests is 2"):
            await anext(backend.stream(req("over")))
        gate.set()
        await asyncio.gather(*tasks)
        for s in held:
            await s.aclose()
        assert backend.num_inflight == 0
        assert [c async for c in backend.stream(req("after"))][0].request_id == "after"

    asyncio.run(main())


def test_router_maps_a_replica_overload_with_its_hint():
    async def main():
        error = TaskError(ReplicaOverloadedError("replica full", retry_after_s=0.25))
        backend = RouterBackend(FakeHandle(lambda r: FakeResponse([], error=error)), None, ModelInfo("m", 64))
        with pytest.raises(OverloadedError, match="replica full") as info:
            await anext(backend.stream(req("x")))
        assert info.value.retry_after_s == 0.25 and backend.num_inflight == 0

    asyncio.run(main())


def test_the_backend_makes_its_generate_handle_again_on_another_loop():
    made = []

    class CountingHandle(FakeHandle):
        def options(self, **kwargs):
            made.append(kwargs)
            return self

    backend = RouterBackend(CountingHandle(lambda r: FakeResponse([chunk(r.request_id)])), None, ModelInfo("m", 64))

    async def send(rid):
        return [c async for c in backend.stream(req(rid))]

    async def two():
        return await send("a") + await send("b")

    assert [c.request_id for c in asyncio.run(two())] == ["a", "b"]
    assert len(made) == 1  # made once per loop, not per request
    assert made[0]["_by_reference"] is False and made[0]["stream"] is True
    assert [c.request_id for c in asyncio.run(send("c"))] == ["c"]  # a new loop: a new handle bound to it
    assert len(made) == 2


def test_replica_overload_survives_pickling():
    exc = pickle.loads(pickle.dumps(ReplicaOverloadedError("full", retry_after_s=3.0)))
    assert str(exc) == "full" and exc.retry_after_s == 3.0


def test_retry_hint_follows_recent_completions():
    from workers.engine.loop_stats import RETRY_HINT_DEFAULT_S, RETRY_HINT_MAX_S, retry_hint

    assert retry_hint([], now=5.0) == RETRY_HINT_DEFAULT_S  # nothing to go by
    assert retry_hint([1.0], now=5.0) == RETRY_HINT_DEFAULT_S
    assert retry_hint([1.0, 1.5, 2.0, 2.5], now=2.6) == 0.5  # one completion every 0.5 s
    assert retry_hint([1.0, 1.5, 2.0, 2.5], now=4.5) == 2.0  # slowed: nothing for 2 s
    assert retry_hint([0.0, 100.0], now=100.0) == RETRY_HINT_MAX_S
