"""Stall detection in stream migration (router/migration.py) with fake streams:
a replica that sends nothing for ``stall_timeout_s`` after an attempt's first
chunk is cancelled and the stream continues elsewhere; a slow first chunk
(queueing, a long prefill) is never a stall."""

from __future__ import annotations

import asyncio

import pytest

from cluster.shared.types import FinishReason, GenerationRequest, SamplingParams, StreamChunk
from router.migration import migrating_choices, migrating_stream

TARGET = list(range(50, 58))
STALL_S = 0.2


def make_request(num_choices: int = 1) -> GenerationRequest:
    return GenerationRequest("r1", [1, 2, 3, 4], SamplingParams(max_tokens=len(TARGET), temperature=0.0,
                                                                  n=num_choices))


class StallingScript:
    """Attempt i continues TARGET from where its prompt ends, waits ``first_wait[i]`` s
    before its first chunk and then hangs forever after ``stall_after[i]`` chunks
    (None: never); records which attempts were cancelled."""

    def __init__(self, stall_after: list, first_wait: list = (), step_s: float = STALL_S / 20) -> None:
        self.step_s = step_s
        self.stall_after = list(stall_after)
        self.first_wait = list(first_wait)
        self.requests: list[GenerationRequest] = []
        self.cancelled: list[int] = []

    async def __call__(self, request: GenerationRequest):
        attempt = len(self.requests)
        self.requests.append(request)
        limit = self.stall_after[attempt] if attempt < len(self.stall_after) else None
        done = len(request.prompt_token_ids) - 4
        todo = TARGET[done: done + request.sampling_params.max_tokens]
        try:
            if attempt < len(self.first_wait):
                await asyncio.sleep(self.first_wait[attempt])
            for i, token in enumerate(todo):
                if i == limit:
                    await asyncio.sleep(3600)  # the node was SIGSTOPped
                if i:
                    await asyncio.sleep(self.step_s)  # a healthy decode step
                yield StreamChunk(request.request_id, [token], f"<{token}>",
                                  FinishReason.LENGTH if i == len(todo) - 1 else None,
                                  replica_id=f"replica-{attempt + 1}")
        except asyncio.CancelledError:
            self.cancelled.append(attempt)
            raise


def run(script: StallingScript, request: GenerationRequest, stall_timeout_s=STALL_S, limit: int = 3,
        on_stall=None):
    async def main():
        stream = migrating_choices(script, request, limit, stall_timeout_s=stall_timeout_s, on_stall=on_stall)
        return [c async for c in stream]

    return asyncio.run(asyncio.wait_for(main(), 10))


def test_a_silent_replica_is_cancelled_and_the_stream_continues_elsewhere():
    script = StallingScript([3])
    stalls: list[str] = []
    chunks = run(script, make_request(), on_stall=stalls.append)
    assert stalls == ["replica-1"]
    assert [t for c in chunks for t in c.token_ids] == TARGET
    assert "".join(c.text for c in chunks) == "".join(f"<{t}>" for t in TARGET)
    assert [c.finish_reason for c in chunks].count(FinishReason.LENGTH) == 1
    assert script.cancelled == [0]  # the stalled call was cancelled
    second = script.requests[1]
    assert second.prompt_token_ids == [1, 2, 3, 4] + TARGET[:3]
    assert second.avoid_replica_ids == ("replica-1",) and second.request_id == "r1-m1"
    assert {c.replica_id for c in chunks[3:]} == {"replica-2"}


def test_a_slow_first_chunk_is_not_a_stall():
    """Queueing and prefill (4x the stall timeout here) come before the first chunk: not timed."""
    script = StallingScript([None, None], first_wait=[STALL_S * 4, STALL_S * 4])
    chunks = run(script, make_request())
    assert [t for c in chunks for t in c.token_ids] == TARGET
    assert len(script.requests) == 1 and script.cancelled == []
    # After a stall the continuation's first chunk (its prefill of prompt + streamed tokens) is not timed either.
    script = StallingScript([2, None], first_wait=[0, STALL_S * 4])
    assert [t for c in run(script, make_request()) for t in c.token_ids] == TARGET
    assert len(script.requests) == 2 and script.requests[1].avoid_replica_ids == ("replica-1",)


def test_replicas_that_keep_stalling_spend_the_migration_limit():
    from router.migration import MigrationLimitError

    script = StallingScript([1, 1, 1])
    with pytest.raises(MigrationLimitError):
        run(script, make_request(), limit=2)
    assert script.cancelled == [0, 1, 2]
    assert script.requests[2].avoid_replica_ids == ("replica-1", "replica-2")


def test_without_a_stall_timeout_a_silent_replica_is_waited_for():
    script = StallingScript([3])

    async def main():
        return [c async for c in migrating_stream(script, make_request(), 3)]

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(asyncio.wait_for(main(), STALL_S * 6))
    assert len(script.requests) == 1


def test_a_timeout_raised_by_the_stream_itself_is_not_a_stall():
    async def attempt(request):
        yield StreamChunk(request.request_id, [TARGET[0]], "x", replica_id="replica-1")
        raise TimeoutError("the replica's own timeout")

    async def main():
        return [c async for c in migrating_stream(attempt, make_request(), 3, stall_timeout_s=STALL_S)]

    with pytest.raises(TimeoutError, match="the replica's own"):
        asyncio.run(main())


def test_a_stalled_several_choice_stream_continues_each_choice():
    """n=2 from one replica that stalls: each unfinished choice continues on its own."""
    calls: list[GenerationRequest] = []

    async def attempt(request):
        calls.append(request)
        if request.sampling_params.num_choices == 2:
            for token in TARGET[:2]:
                for index in (0, 1):
                    yield StreamChunk(request.request_id, [token], "", index=index, more_choices=True,
                                      replica_id="replica-1")
            await asyncio.sleep(3600)
        done = len(request.prompt_token_ids) - 4
        for i, token in enumerate(TARGET[done:]):
            yield StreamChunk(request.request_id, [token], "", FinishReason.LENGTH if token == TARGET[-1] else None,
                              replica_id="replica-2")

    chunks = run(attempt, make_request(num_choices=2))
    for index in (0, 1):
        assert [t for c in chunks if c.index == index for t in c.token_ids] == TARGET
    assert len(calls) == 3 and all(c.avoid_replica_ids == ("replica-1",) for c in calls[1:])


def test_the_backend_keeps_new_requests_off_a_stalled_replica_for_a_while(monkeypatch):
    from router import backend as backend_module
    from router.migration import STALL_AVOID_S

    now = [100.0]
    monkeypatch.setattr(backend_module.time, "monotonic", lambda: now[0])
    backend = backend_module.RouterBackend(handle=None, tokenizer=None, model=None)
    assert backend.stalled_replica_ids() == ()
    backend.note_stall("r-a")
    now[0] += STALL_AVOID_S / 2
    backend.note_stall("r-b")
    assert backend.stalled_replica_ids() == ("r-a", "r-b")
    now[0] += STALL_AVOID_S / 2 + 0.1
    assert backend.stalled_replica_ids() == ("r-b",)
    now[0] += STALL_AVOID_S
    assert backend.stalled_replica_ids() == () and not backend.stalled_at


def test_a_stream_slower_in_total_than_the_timeout_but_never_silent_that_long_is_no_stall():
    """Each gap is 0.6 of the timeout, the stream 4x it: the one timer re-arms from each wait."""
    script = StallingScript([None], step_s=STALL_S * 0.6)
    chunks = run(script, make_request())
    assert [t for c in chunks for t in c.token_ids] == TARGET
    assert len(script.requests) == 1 and script.cancelled == []


def test_a_cancel_from_outside_stays_a_cancel():
    """The client's deadline cancels the stream while the watch waits: no migration, a cancel."""
    script = StallingScript([3])

    async def main():
        stream = migrating_stream(script, make_request(), 3, stall_timeout_s=60)
        consumer = asyncio.ensure_future(_drain(stream))
        await asyncio.sleep(STALL_S)  # three chunks in, waiting on the silent replica
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        await stream.aclose()

    asyncio.run(main())
    assert len(script.requests) == 1 and script.cancelled == [0]  # by the client, not migrated


async def _drain(stream):
    return [c async for c in stream]
