"""The router's side of the direct token stream (``replica_transport="direct"``).

Serve routes, admits and cancels the request as a unary call
(``ReplicaServer.generate_direct``); its chunks come back over a TCP
connection the replica opened to this router's ``DirectSink``, written by
the replica's engine thread once per step (``workers/engine/direct_stream.py`` has
the picture and the figures). One ``direct_attempt`` is one such call:

    chunks   <- the sink, demultiplexed by a random per-attempt key
    reply    <- Serve: the number of chunks sent, or the replica's error
                (ValueError, overload, its death), handed to the same queue

The attempt ends at the finished chunk. A reply that arrives before all the
chunks it counts (the two paths race) waits for them; a death or an error
ends the attempt with that error, so migration (``router/migration.py``)
sees the same errors as with Serve's stream. Cancelling the attempt cancels
the Serve call, which aborts the sequence in the replica.

The sink reads pickles only on a connection that began with its secret
(32 random hex characters, passed to replicas inside Serve's call, as Ray's
own internal traffic is trusted); it binds this node's address, which the
replicas reach whether or not they share the node.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import secrets
from typing import Any, AsyncIterator, Callable, Optional

from cluster.shared.direct_wire import FRAME_HEADER, MAX_FRAME_BYTES, SECRET_BYTES
from cluster.shared.types import StreamChunk

logger = logging.getLogger(__name__)

LATE_CHUNKS_S = 10.0  # how long chunks may trail the reply that counted them


class _Reply:
    """Serve's reply to ``generate_direct``, as a queue item."""

    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future) -> None:
        self.future = future


class _SinkProtocol(asyncio.Protocol):
    """One replica's connection: the secret, then length-prefixed frames."""

    def __init__(self, sink: "DirectSink") -> None:
        self.sink = sink
        self.buffer = bytearray()
        self.trusted = False
        self.transport: Optional[asyncio.Transport] = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.sink.connections.add(self)

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self.sink.connections.discard(self)

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        if not self.trusted:
            if len(buffer) < SECRET_BYTES:
                return
            if not secrets.compare_digest(bytes(buffer[:SECRET_BYTES]), self.sink.secret.encode("ascii")):
                logger.warning("direct sink: a connection without this router's secret was closed")
                assert self.transport is not None
                self.transport.close()
                buffer.clear()
                return
            self.trusted = True
            del buffer[:SECRET_BYTES]
        start, end = 0, len(buffer)
        receivers = self.sink.receivers
        while end - start >= 4:
            (size,) = FRAME_HEADER.unpack_from(buffer, start)
            if size > MAX_FRAME_BYTES:
                logger.error("direct sink: a %d-byte frame is over the limit; connection closed", size)
                assert self.transport is not None
                self.transport.close()
                buffer.clear()
                return
            if end - start - 4 < size:
                break
            batch = pickle.loads(memoryview(buffer)[start + 4:start + 4 + size])
            start += 4 + size
            for key, chunk in batch:
                queue = receivers.get(key)
                if queue is not None:  # else its attempt ended (cancelled): dropped
                    queue.put_nowait(chunk)
        del buffer[:start]


class DirectSink:
    """The TCP endpoint replicas stream this router's chunks to.

    Args:
        host: The address to bind and advertise (this node's, so replicas on
            other nodes reach it).
    """

    def __init__(self, host: str) -> None:
        self.host = host
        self.port = 0
        self.secret = secrets.token_hex(SECRET_BYTES // 2)
        self.receivers: dict[str, asyncio.Queue] = {}
        self.connections: set[_SinkProtocol] = set()
        self._server: Optional[asyncio.AbstractServer] = None

    async def start(self) -> "DirectSink":
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _SinkProtocol(self), self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("direct token sink on %s:%d", self.host, self.port)
        return self

    @property
    def address(self) -> tuple[str, int, str]:
        """What ``generate_direct`` connects to: host, port and the secret."""
        return self.host, self.port, self.secret

    def open(self) -> tuple[str, asyncio.Queue]:
        """A new attempt's key and the queue its chunks arrive in."""
        key = secrets.token_hex(8)
        queue: asyncio.Queue = asyncio.Queue()
        self.receivers[key] = queue
        return key, queue

    def close_key(self, key: str) -> None:
        self.receivers.pop(key, None)

    async def aclose(self) -> None:
        """Stops listening and closes the replicas' connections (their streams fail there)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for protocol in list(self.connections):
            if protocol.transport is not None:
                protocol.transport.close()


async def direct_attempt(call: Any, sink: DirectSink, request: Any,
                         map_error: Callable[[BaseException], BaseException]) -> AsyncIterator[StreamChunk]:
    """One ``generate_direct`` call (``call``: the handle's unary options) through ``sink``.

    Yields the chunks up to the finished one; raises ``map_error`` of the
    reply's error (the caller's mapping of Serve's and the replica's errors).
    """
    key, queue = sink.open()
    response = call.remote(request, sink.address, key)
    reply = asyncio.ensure_future(_await(response))
    reply.add_done_callback(lambda future: queue.put_nowait(_Reply(future)))
    finished = False
    num_received = 0
    expected: Optional[int] = None
    try:
        while True:
            if expected is None:
                item = await queue.get()
            else:
                try:
                    item = await asyncio.wait_for(queue.get(), LATE_CHUNKS_S)
                except asyncio.TimeoutError:
                    raise ConnectionError(f"the replica sent {expected} chunks, {num_received} arrived within "
                                          f"{LATE_CHUNKS_S:.0f}s of its reply (direct stream)") from None
            if isinstance(item, _Reply):
                error = item.future.exception()
                if error is not None:
                    raise map_error(error) from error
                expected = item.future.result()
                if num_received >= expected:  # ended without a finished chunk (cannot happen): say so
                    raise ConnectionError("the replica's direct stream ended without its last chunk")
                continue
            num_received += 1
            if item.finished:
                finished = True
            yield item
            if finished:
                return
    finally:
        sink.close_key(key)
        if not reply.done() and not finished:
            response.cancel()  # aborts the sequence
        reply.add_done_callback(_retrieve)  # an error no one reads is not reported as unretrieved


async def _await(response: Any) -> Any:
    return await response


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()
