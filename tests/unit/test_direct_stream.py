"""The direct token stream (``replica_transport="direct"``) without Ray: a
real ``ReplicaServer`` on a fake engine streams over real loopback sockets to
the router's ``DirectSink``; Serve's unary call is played by a task."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from cluster.shared.types import GenerationRequest, SamplingParams, StreamChunk
from router import direct
from router.direct import DirectSink, direct_attempt
from tests.unit.engine_fakes import FINGERPRINT, VOCAB, FakeRunner, make_scheduler, next_token
from workers.engine.direct_stream import DirectStreamError
from workers.engine.engine import LLMEngine
from workers.replica import ReplicaServer


def make_replica(stream_interval: int = 1, token_s: float = 0.0) -> ReplicaServer:
    """``token_s``: seconds the fake model takes per token (a request that must still be running later)."""
    scheduler = make_scheduler(64, 0, max_num_seqs=4, max_model_len=256)

    def model(token_ids):
        time.sleep(token_s)
        return next_token(token_ids)

    runner = FakeRunner.for_scheduler(scheduler, model if token_s else next_token)
    engine = LLMEngine(scheduler, runner, None, vocab_size=VOCAB, max_model_len=256, model_fingerprint=FINGERPRINT)
    return ReplicaServer({"stream_interval": stream_interval}, engine=engine, replica_id="r0")


def req(rid: str, max_tokens: int = 12, prompt=(5, 6, 7, 8, 9)) -> GenerationRequest:
    return GenerationRequest(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0))


class FakeResponse:
    """Serve's ``DeploymentResponse`` of a unary call: awaitable, cancellable."""

    def __init__(self, coro) -> None:
        self.task = asyncio.ensure_future(coro)
        self.num_cancels = 0

    def __await__(self):
        return self.task.__await__()

    def cancel(self) -> None:
        self.num_cancels += 1
        self.task.cancel()


class FakeCall:
    """``handle.options(method_name="generate_direct")``, calling the replica in this loop."""

    def __init__(self, replica: ReplicaServer) -> None:
        self.replica = replica
        self.responses: list[FakeResponse] = []

    def remote(self, request, sink, key) -> FakeResponse:
        response = FakeResponse(self.replica.generate_direct(request, sink, key))
        self.responses.append(response)
        return response


def identity(exc: BaseException) -> BaseException:
    return exc


async def used_blocks(replica: ReplicaServer) -> int:
    return await replica._front.call(lambda engine: engine.scheduler.kv_manager.device_pool.num_used_blocks)


async def collect(stream) -> list[StreamChunk]:
    return [chunk async for chunk in stream]


@pytest.mark.parametrize("interval", [1, 3])
def test_direct_chunks_are_the_streamed_chunks(interval):
    replica = make_replica(interval)

    async def main():
        sink = await DirectSink("127.0.0.1").start()
        call = FakeCall(replica)
        via_serve = [await collect(replica.generate(req(f"s{i}", 10 + i))) for i in range(2)]
        direct_runs = await asyncio.gather(*(collect(direct_attempt(call, sink, req(f"d{i}", 10 + i), identity))
                                             for i in range(2)))
        counts = [await response for response in call.responses]
        await sink.aclose()
        return via_serve, direct_runs, counts

    try:
        via_serve, direct_runs, counts = asyncio.run(main())
    finally:
        replica.shutdown()
    for streamed, pushed, count in zip(via_serve, direct_runs, counts):
        assert sum((c.token_ids for c in pushed), []) == sum((c.token_ids for c in streamed), [])
        sizes = [len(c.token_ids) for c in pushed]  # the engine thread sends every step: nothing merges
        assert sizes[0] == 1 and all(size == interval for size in sizes[1:-1]) and sizes[-1] <= interval
        assert [c.finish_reason for c in pushed][-1] == streamed[-1].finish_reason is not None
        assert all(c.finish_reason is None for c in pushed[:-1])
        assert pushed[-1].finished and pushed[-1].completion_tokens == streamed[-1].completion_tokens
        assert {c.replica_id for c in pushed} == {"r0"}
        assert count == len(pushed)


def test_closing_an_attempt_cancels_the_call_and_frees_the_blocks():
    # 2 ms a token: its 200 tokens outlast the close (instant tokens once all ran before it, under load).
    replica = make_replica(token_s=0.002)

    async def main():
        sink = await DirectSink("127.0.0.1").start()
        call = FakeCall(replica)
        stream = direct_attempt(call, sink, req("c", max_tokens=200), identity)
        first = [await stream.__anext__() for _ in range(2)]
        await stream.aclose()
        with pytest.raises(asyncio.CancelledError):
            await call.responses[0].task
        for _ in range(100):
            if await used_blocks(replica) == 0:
                break
            await asyncio.sleep(0.01)
        left = await used_blocks(replica)
        connections = list(replica._sinks._connections.values())
        await sink.aclose()
        return first, call.responses[0].num_cancels, left, connections, dict(sink.receivers)

    try:
        first, cancels, left, connections, receivers = asyncio.run(main())
    finally:
        replica.shutdown()
    assert len(first) == 2 and not first[-1].finished
    assert cancels == 1 and left == 0 and receivers == {}
    assert [len(conn.streams) for conn in connections] == [0]


def test_an_invalid_request_raises_its_error_and_sends_nothing():
    replica = make_replica()

    async def main():
        sink = await DirectSink("127.0.0.1").start()
        try:
            return await collect(direct_attempt(FakeCall(replica), sink, req("bad", prompt=(5, VOCAB + 3)), identity))
        finally:
            await sink.aclose()

    try:
        with pytest.raises(ValueError, match="token"):
            asyncio.run(main())
    finally:
        replica.shutdown()


def test_a_router_that_goes_away_ends_the_replica_streams_and_frees_their_blocks():
    # 2 ms a token: the 240-token request is still running when the sink closes (with instant tokens it
    # once finished first under the suite's load, and nothing raised).
    replica = make_replica(token_s=0.002)

    async def main():
        sink = await DirectSink("127.0.0.1").start()
        call = FakeCall(replica)
        stream = direct_attempt(call, sink, req("gone", max_tokens=240), identity)
        await stream.__anext__()
        await sink.aclose()  # the router process is gone: its end of every connection closes
        with pytest.raises(DirectStreamError):
            await asyncio.wait_for(call.responses[0].task, 10)
        for _ in range(100):
            if await used_blocks(replica) == 0:
                break
            await asyncio.sleep(0.01)
        return await used_blocks(replica)

    try:
        assert asyncio.run(main()) == 0
    finally:
        replica.shutdown()


def test_the_sink_closes_a_connection_without_its_secret():
    async def main():
        sink = await DirectSink("127.0.0.1").start()
        key, queue = sink.open()
        reader, writer = await asyncio.open_connection("127.0.0.1", sink.port)
        writer.write(b"0" * 32 + b"\x00" * 8)
        await writer.drain()
        closed = await asyncio.wait_for(reader.read(), 5) == b""  # EOF: the sink hung up
        await sink.aclose()
        return closed, queue.qsize()

    closed, queued = asyncio.run(main())
    assert closed and queued == 0


def test_chunks_that_trail_the_reply_are_waited_for_and_missing_ones_are_an_error(monkeypatch):
    monkeypatch.setattr(direct, "LATE_CHUNKS_S", 0.3)

    class Early:
        """A reply counting ``sent`` chunks that arrives before them; ``delivered`` of them come later."""

        def __init__(self, sink, sent, delivered):
            self.sink, self.sent, self.delivered = sink, sent, delivered

        def remote(self, request, address, key):
            loop = asyncio.get_running_loop()
            for i in range(self.delivered):
                chunk = StreamChunk("x", [i], "t", finish_reason="length" if i == self.sent - 1 else None)
                loop.call_later(0.05 * (i + 1), self.sink.receivers[key].put_nowait, chunk)

            async def reply():
                return self.sent

            return FakeResponse(reply())

    async def main(delivered):
        sink = await DirectSink("127.0.0.1").start()
        try:
            return await collect(direct_attempt(Early(sink, 3, delivered), sink, req("e"), identity))
        finally:
            await sink.aclose()

    assert [c.token_ids for c in asyncio.run(main(3))] == [[0], [1], [2]]
    with pytest.raises(ConnectionError, match="3 chunks, 2 arrived"):
        asyncio.run(main(2))


def test_the_replica_cannot_reach_a_sink_that_is_not_there():
    replica = make_replica()
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def main():
        return await replica.generate_direct(req("n"), ("127.0.0.1", port, "0" * 32), "k")

    try:
        with pytest.raises(ConnectionError):
            asyncio.run(main())
    finally:
        replica.shutdown()


def test_ray_tls_keeps_the_tokens_on_serves_channel(monkeypatch):
    from router.backend import ModelInfo, RouterBackend

    model = ModelInfo("m", 256)
    assert RouterBackend(object(), object(), model, replica_transport="direct").replica_transport == "direct"
    monkeypatch.setenv("RAY_USE_TLS", "1")
    assert RouterBackend(object(), object(), model, replica_transport="direct").replica_transport == "grpc"
    assert RouterBackend(object(), object(), model, replica_transport="actor").replica_transport == "actor"


def test_direct_completions_feed_the_overload_retry_hint():
    replica = make_replica()

    async def main():
        sink = await DirectSink("127.0.0.1").start()
        try:
            for i in range(3):
                await collect(direct_attempt(FakeCall(replica), sink, req(f"h{i}", max_tokens=4), identity))
            await asyncio.sleep(0.05)  # the replies settle
        finally:
            await sink.aclose()

    try:
        asyncio.run(main())
        assert len(replica._front._finish_times) == 3
    finally:
        replica.shutdown()
