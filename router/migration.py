"""Stream migration: a request whose replica dies keeps streaming from another.

When the replica serving a stream dies (its actor is killed, its process
crashes, its node goes away), Serve's response raises one of Ray's
actor-death errors. ``migrating_stream`` then re-issues the request to another
live replica with the prompt *plus every token already streamed* and
``max_tokens`` reduced by as many, so the client's stream simply continues:

    attempt 1 (replica A):  prompt            -> t1 t2 t3 ✕ (A dies)
    attempt 2 (replica B):  prompt t1 t2 t3   -> t4 t5 ... (finish)
    client sees:            t1 t2 t3 t4 t5 ...  one stream, one finish reason

No token is duplicated or lost: the continuation starts exactly after the last
chunk the client received. For greedy sampling the output is the one an
undisturbed run gives (the continuation's prefill computes the same KV the
first replica had; its prefix cache may even hold the prompt). A request that
dies before its first token is simply retried. Usage is reported as for one
request: ``prompt_tokens`` of the original prompt, ``completion_tokens`` of
all attempts, ``cached_prompt_tokens`` of the first attempt.

Text: after a migration the router detokenizes the stream itself, with the
replicas' incremental detokenizer (``cluster/shared/detokenizer.py``) replayed
from the original prompt over every streamed token. The client's text is then
exactly what one undisturbed replica would have sent, also where a
multi-byte character or an invalid byte sequence straddles the migration
point, and a stop string that straddles it is found (the stream ends there
with ``stop``; the replica's sequence is aborted).

Limits (documented, not hidden): seeded random sampling continues with the
new replica's generator state, so a migrated sampled stream is a valid sample
but not the same one; ``frequency_penalty`` / ``presence_penalty`` count only
output tokens, and after a migration the streamed tokens are part of the
prompt, so those penalties see fewer tokens.

Several choices (``n`` / ``best_of`` > 1) stream from one replica as one
request, their chunks tagged with ``index``. When that replica dies, each
unfinished choice continues on its own as a one-choice request (its seed
``seed + index``, as the engine derives it) from its own streamed tokens;
their chunks are merged into the one stream (``migrating_choices``). A
request that dies before any token is retried whole.

A replica that goes silent is treated as dead: with ``stall_timeout_s`` set
(``RouterConfig.stall_timeout_s``, default 20 s), an attempt that has sent
its first chunk and then sends nothing for that long is cancelled (the
Serve call's ``cancel()``, which aborts the sequence if the replica ever
wakes up) and migrates like a death (``router/stall.py``: one timer per
attempt, ~0.7 µs of router CPU a chunk against ~5 µs for an
``asyncio.timeout`` per chunk). Silence is measured only after an
attempt's first chunk: queueing and the prefill (of the prompt, or of prompt
+ streamed tokens after a migration) may legitimately take long and scale
with the prompt, while between two decode steps a healthy replica's
silence is bounded by one step (chunked prefill caps a step's tokens) plus a
preemption's wait. The continuation names the silent replica in
``GenerationRequest.avoid_replica_ids`` so the request router sends it
elsewhere while the directory still lists the stalled replica as live (its
heartbeats lapse only after the TTL, and each router's copy of the
directory a poll later), and the router's backend (``on_stall``) keeps *new*
requests away from it for ``STALL_AVOID_S`` (15 s, past the directory's TTL
and a follower poll). A false alarm costs a recompute on another replica
(a greedy stream's text is the same either way) and 15 s without new
requests for a healthy replica. A request that reached a stalled replica
before anyone noticed and got no first chunk yet waits for its deadline, or
for Serve's health check (60 s) to end the replica, then is retried.

At most ``migration_limit`` migrations per request (default 3, like Dynamo's
``--migration-limit``); past that the request fails with ``NoReplicaError``
(gRPC ``UNAVAILABLE``) saying how often it moved.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import AsyncIterator, Callable, Optional

from cluster.shared.choices import choice_params
from cluster.shared.detokenizer import IncrementalDetokenizer, TokenDecoder
from cluster.shared.types import FinishReason, GenerationRequest, StreamChunk
from router.stall import ReplicaStalledError, WatchedAttempt
from router.streams import merge_indexed

logger = logging.getLogger(__name__)

DEFAULT_MIGRATION_LIMIT = 3
DEFAULT_STALL_TIMEOUT_S = 20.0
STALL_AVOID_S = 15.0  # how long new requests avoid a replica that stalled (module doc)

OpenStream = Callable[[GenerationRequest], AsyncIterator[StreamChunk]]


class MigrationLimitError(RuntimeError):
    """The request's replicas died more often than the migration limit allows."""


def _should_migrate(exc: BaseException) -> bool:
    return isinstance(exc, ReplicaStalledError) or is_replica_death(exc)


def is_replica_death(exc: BaseException) -> bool:
    """Whether ``exc`` says the replica serving a stream died (not a request error)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    for candidate in (exc, getattr(exc, "cause", None), exc.__cause__):
        if isinstance(candidate, (ActorDiedError, ActorUnavailableError, RayActorError)):
            return True
    return False


def _next_migration(exc: BaseException, request: GenerationRequest, migrations: int, migration_limit: int,
                    what: str) -> int:
    """The count after one more migration for the replica's death ``exc`` (logged).

    Raises:
        MigrationLimitError: From ``exc``, once the limit is spent.
    """
    if migrations >= migration_limit:
        raise MigrationLimitError(
            f"request {request.request_id}: its replica died after {migrations} migration(s), the "
            f"migration limit ({migration_limit}); retry it or raise --migration-limit") from exc
    logger.warning("request %s: replica %s %s: migrating (%d of at most %d)", request.request_id,
                   "stalled" if isinstance(exc, ReplicaStalledError) else "died", what, migrations + 1,
                   migration_limit)
    return migrations + 1


def continuation(request: GenerationRequest, generated: list[int], attempt: int,
                 avoid_replica_ids: tuple[str, ...] = ()) -> GenerationRequest:
    """The request that continues ``request`` after ``generated`` tokens were streamed
    (on a replica other than ``avoid_replica_ids``, those that stalled)."""
    sampling = request.sampling_params
    remaining = sampling.max_tokens - len(generated) if sampling.max_tokens is not None else None
    new_sampling = dataclasses.replace(sampling, max_tokens=remaining)
    if getattr(sampling, "min_tokens", 0):
        new_sampling = dataclasses.replace(new_sampling, min_tokens=max(0, sampling.min_tokens - len(generated)))
    return dataclasses.replace(
        request,
        request_id=f"{request.request_id}-m{attempt}",
        prompt_token_ids=list(request.prompt_token_ids) + list(generated),
        sampling_params=new_sampling,
        # A structured-output constraint resumes after the streamed tokens (the replica replays them).
        num_resumed_output_tokens=request.num_resumed_output_tokens + len(generated),
        avoid_replica_ids=avoid_replica_ids,
    )


class _Retext:
    """The router's own detokenizer of a migrated stream: the replica's
    algorithm, replayed from the original prompt over every streamed token."""

    def __init__(self, tokenizer: TokenDecoder, request: GenerationRequest, generated: list[int], sent: str) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, request.sampling_params.stop)
        replayed = self.detok.append(generated)
        # What the dead replica computed but held back (a stop-string window or
        # an incomplete character) is owed to the client.
        self.owed = replayed[len(sent):] if replayed.startswith(sent) else ""

    def text_of(self, chunk: StreamChunk) -> str:
        text = self.owed + self.detok.append(chunk.token_ids)
        self.owed = ""
        if chunk.finished or self.detok.stopped:
            text += self.detok.flush()
        return text

    def final_text(self) -> str:
        text, self.owed = self.owed + self.detok.flush(), ""
        return text


async def migrating_stream(open_stream: OpenStream, request: GenerationRequest,
                           migration_limit: int = DEFAULT_MIGRATION_LIMIT,
                           tokenizer: Optional[TokenDecoder] = None,
                           resume: Optional[tuple[list[int], str, int, int]] = None,
                           stall_timeout_s: Optional[float] = None,
                           avoid_replica_ids: tuple[str, ...] = (),
                           on_stall: Optional[Callable[[str], None]] = None) -> AsyncIterator[StreamChunk]:
    """Streams ``request`` through ``open_stream``, migrating when a replica dies or stalls.

    Args:
        open_stream: Starts one attempt (a Serve streaming call) and yields its chunks.
        request: The client's request.
        migration_limit: Most migrations for this request (>= 0).
        tokenizer: The model's tokenizer (``decode(ids, skip_special_tokens)``):
            after a migration the text is detokenized here, as one replica
            would have (see the module doc). None: the replicas' text as is.
        resume: ``(generated, sent, cached, migrations)`` of a stream whose
            replica already died: it continues after those tokens.
        stall_timeout_s: Seconds without a chunk, after an attempt's first,
            that count as its replica's death (None: never).
        avoid_replica_ids: Replicas that stalled before ``resume``: its
            continuation asks for another.
        on_stall: Called with the id of each replica that stalled (the
            backend then keeps new requests away from it for a while).

    Raises:
        MigrationLimitError: A replica died after ``migration_limit`` migrations.
        Whatever ``open_stream`` raises that is not a replica death.
    """
    if migration_limit < 0:
        raise ValueError(f"migration_limit must be >= 0, got {migration_limit}")
    generated: list[int] = list(resume[0]) if resume else []
    sent = resume[1] if resume else ""  # text the client received
    retext: Optional[_Retext] = None
    prompt_tokens = len(request.prompt_token_ids)
    cached: Optional[int] = resume[2] if resume else None
    current = request
    migrations = resume[3] if resume else 0
    avoid = avoid_replica_ids
    if resume:
        retext = _Retext(tokenizer, request, generated, sent) if tokenizer is not None else None
        if len(generated) >= request.sampling_params.max_tokens:  # only the final chunk was lost
            text = retext.final_text() if retext is not None else ""
            yield StreamChunk(request.request_id, [], text, FinishReason.LENGTH, prompt_tokens=prompt_tokens,
                              completion_tokens=len(generated), cached_prompt_tokens=cached or 0)
            return
        current = continuation(request, generated, migrations, avoid)
    while True:
        attempt = WatchedAttempt(open_stream(current), stall_timeout_s)
        try:
            async for chunk in attempt:
                generated.extend(chunk.token_ids)
                if cached is None:
                    cached = chunk.cached_prompt_tokens
                if migrations:
                    stopped = retext is not None and retext.detok.stopped
                    text = retext.text_of(chunk) if retext is not None else chunk.text
                    if retext is not None and retext.detok.stopped and not stopped:
                        chunk = dataclasses.replace(chunk, finish_reason=FinishReason.STOP)
                    chunk = dataclasses.replace(
                        chunk, request_id=request.request_id, text=text, prompt_tokens=prompt_tokens,
                        completion_tokens=len(generated), cached_prompt_tokens=cached or 0)
                sent += chunk.text
                yield chunk
                if chunk.finished:
                    return  # a stop string found here ends the stream (closing it aborts the replica's)
            return
        except Exception as exc:  # noqa: BLE001 - only replica deaths and stalls are migrated
            if not _should_migrate(exc):
                raise
            migrations = _next_migration(exc, request, migrations, migration_limit,
                                         f"after {len(generated)} streamed token(s)")
            stalled = attempt.stalled_replica(exc)
            if stalled:
                avoid = tuple(dict.fromkeys((*avoid, stalled)))
                if on_stall is not None:
                    on_stall(stalled)
        finally:
            await attempt.aclose()
        retext = _Retext(tokenizer, request, generated, sent) if tokenizer is not None else None
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and len(generated) >= max_tokens:
            # Every token arrived; only the final chunk was lost with the replica.
            text = retext.final_text() if retext is not None else ""
            yield StreamChunk(request.request_id, [], text, FinishReason.LENGTH, prompt_tokens=prompt_tokens,
                              completion_tokens=len(generated), cached_prompt_tokens=cached or 0)
            return
        current = continuation(request, generated, migrations, avoid)


def choice_request(request: GenerationRequest, index: int) -> GenerationRequest:
    """Choice ``index`` of a request with several, as a one-choice request of its own
    (the seed the engine gives that choice; prompt logprobs were sent with the first chunk)."""
    params = dataclasses.replace(choice_params(request.sampling_params, index), prompt_logprobs=None)
    return dataclasses.replace(request, request_id=f"{request.request_id}-c{index}", sampling_params=params)


async def migrating_choices(open_stream: OpenStream, request: GenerationRequest,
                            migration_limit: int = DEFAULT_MIGRATION_LIMIT,
                            tokenizer: Optional[TokenDecoder] = None,
                            stall_timeout_s: Optional[float] = None,
                            on_stall: Optional[Callable[[str], None]] = None) -> AsyncIterator[StreamChunk]:
    """``migrating_stream`` for a request with any number of choices (see the module doc).

    Raises:
        As ``migrating_stream``.
    """
    num_choices = request.sampling_params.num_choices
    if num_choices == 1:
        async for chunk in migrating_stream(open_stream, request, migration_limit, tokenizer,
                                            stall_timeout_s=stall_timeout_s, on_stall=on_stall):
            yield chunk
        return
    if migration_limit < 0:
        raise ValueError(f"migration_limit must be >= 0, got {migration_limit}")
    migrations = 0
    while True:
        generated: list[list[int]] = [[] for _ in range(num_choices)]
        sent = [""] * num_choices
        done = [False] * num_choices
        cached: Optional[int] = None
        attempt = WatchedAttempt(open_stream(request), stall_timeout_s)
        try:
            async for chunk in attempt:
                generated[chunk.index].extend(chunk.token_ids)
                sent[chunk.index] += chunk.text
                cached = chunk.cached_prompt_tokens if cached is None else cached
                done[chunk.index] = done[chunk.index] or chunk.finish_reason is not None
                yield chunk
                if chunk.finished:
                    return
            return
        except Exception as exc:  # noqa: BLE001 - only replica deaths and stalls are migrated
            if not _should_migrate(exc):
                raise
            migrations = _next_migration(exc, request, migrations, migration_limit,
                                         f"with {done.count(False)} choice(s) unfinished")
            replica = attempt.stalled_replica(exc)
            stalled = (replica,) if replica else ()
            if replica and on_stall is not None:
                on_stall(replica)
        finally:
            await attempt.aclose()
        if any(generated):
            break  # each choice continues on its own below
    pending = [i for i in range(num_choices) if not done[i]]
    streams = {i: migrating_stream(open_stream, choice_request(request, i), migration_limit, tokenizer,
                                   resume=(generated[i], sent[i], cached or 0, migrations),
                                   stall_timeout_s=stall_timeout_s, avoid_replica_ids=stalled, on_stall=on_stall)
               for i in pending}
    merged = merge_indexed(list(streams.values()), list(streams), [1] * len(streams))
    try:
        async for chunk in merged:
            yield chunk
    finally:
        await merged.aclose()
