"""The replica's side of the direct token stream (``replica_transport="direct"``).

Serve's streaming path costs ~0.5 ms of CPU per chunk on the router's side
and ~0.7 ms on the replica's (a stub deployment, this 2-core machine;
``docs/ARCHITECTURE.md``), and each chunk wakes the replica's event loop
too. On 2 cores that CPU comes out of the forward's threads. With the direct
transport Serve still routes, admits, cancels and reports deaths: the router
calls ``ReplicaServer.generate_direct`` (``workers/direct_endpoint.py``) as a *unary* Serve call that returns
when the request ends, and the tokens travel over one TCP connection per
(replica process, router process), written by the engine thread itself:

    router                                   replica
      generate_direct(request, sink, key) --Serve--> run_direct ---+
      sink <--[len][pickle([(key, chunk), ...])]-- engine thread    | after each step:
      reply (chunks sent) <--Serve---------- returns at the finish <+ one frame per
                                                                     connection

- One frame per connection per step holds every chunk of that step for that
  router (``SinkConnections.flush`` after the step): one ``send`` however
  many requests are streaming. No event-loop wake-up per token on the replica.
- The connection starts with the router's secret (``DirectSink``): a router
  reads pickles only from a peer that knows it, handed over inside Serve's
  call, like Ray's own internal traffic.
- The engine thread never blocks on a slow router: ``send`` is non-blocking,
  what the kernel does not take waits in the connection's buffer and the
  replica's loop writes it when the socket drains.
- A router that goes away (the connection breaks) fails the streams that
  were writing to it; ``generate_direct`` then raises and its sequence is
  aborted, so its blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket
import threading
from typing import Any, Callable, Optional

from cluster.shared.direct_wire import FRAME_HEADER
from cluster.shared.types import StreamChunk
from workers.engine.loop_stats import settle_future
from workers.engine.outputs import RequestOutput, chunk_due, merge_outputs

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0


class DirectStreamError(ConnectionError):
    """The connection to the router broke (the router went away)."""


class SinkConnection:
    """One connection to one router's sink; written from the engine thread.

    ``queue`` adds a chunk to the frame being built; ``flush`` sends that frame
    (engine thread, after each step, and at a finish). Bytes the socket does
    not take are written later by ``loop`` (never blocking the caller).
    """

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop, address: tuple[str, int]) -> None:
        self.sock = sock
        self.loop = loop
        self.address = address
        self.broken: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._batch: list[tuple[str, StreamChunk]] = []
        self._pending = bytearray()  # bytes the kernel has not taken yet
        self._writer_armed = False
        self.streams: set["DirectStream"] = set()

    def queue(self, key: str, chunk: StreamChunk) -> None:
        with self._lock:
            self._batch.append((key, chunk))

    def flush(self) -> None:
        """Sends the chunks queued since the last flush as one frame."""
        with self._lock:
            if not self._batch or self.broken is not None:
                self._batch.clear()
                return
            body = pickle.dumps(self._batch, protocol=pickle.HIGHEST_PROTOCOL)
            self._batch = []
            self._pending += FRAME_HEADER.pack(len(body)) + body
            if self._writer_armed:  # the loop is draining earlier bytes: keep the order
                return
            error = self._send_pending()
            if error is None and self._pending:
                self._writer_armed = True
                self.loop.call_soon_threadsafe(self._arm_writer)
        if error is not None:
            self.fail(error)

    def _send_pending(self) -> Optional[BaseException]:
        """Under the lock: what the socket takes now."""
        try:
            sent = self.sock.send(self._pending)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as exc:
            return exc
        del self._pending[:sent]
        return None

    def _arm_writer(self) -> None:
        self.loop.add_writer(self.sock.fileno(), self._on_writable)

    def _on_writable(self) -> None:  # the replica's loop
        with self._lock:
            error = self._send_pending()
            done = error is not None or not self._pending
            if done:
                self._writer_armed = False
        if done:
            self.loop.remove_writer(self.sock.fileno())
        if error is not None:
            self.fail(error)

    def fail(self, error: BaseException) -> None:
        """The router is gone: every stream writing here fails (its sequence is aborted)."""
        with self._lock:
            if self.broken is not None:
                return
            self.broken = error
            streams = list(self.streams)
        logger.warning("direct stream to %s:%d broke: %r", *self.address, error)
        for stream in streams:
            stream.put(DirectStreamError(f"the router at {self.address[0]}:{self.address[1]} went away: {error!r}"))
        try:
            self.sock.close()
        except OSError:
            pass


class SinkConnections:
    """This replica process's connections, one per router sink address."""

    def __init__(self) -> None:
        self._connections: dict[tuple[str, int], SinkConnection] = {}
        self._connecting: dict[tuple[str, int], asyncio.Future] = {}

    async def get(self, host: str, port: int, secret: str) -> SinkConnection:
        """The open connection to ``host:port`` (made now, on the caller's loop, if none)."""
        address = (host, int(port))
        conn = self._connections.get(address)
        if conn is not None and conn.broken is None:
            return conn
        pending = self._connecting.get(address)
        if pending is not None:
            return await asyncio.shield(pending)
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._connecting[address] = future
        try:
            sock = await asyncio.wait_for(asyncio.to_thread(_connect, address, secret), CONNECT_TIMEOUT_S)
            conn = SinkConnection(sock, loop, address)
            self._connections[address] = conn
            future.set_result(conn)
            return conn
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: joiners get it through shield
            raise
        finally:
            del self._connecting[address]

    def flush(self) -> None:
        """Engine thread, after a step: one frame per connection that has chunks."""
        for conn in list(self._connections.values()):
            conn.flush()

    def close(self) -> None:
        for conn in self._connections.values():
            try:
                conn.sock.close()
            except OSError:
                pass
        self._connections.clear()


def _connect(address: tuple[str, int], secret: str) -> socket.socket:
    sock = socket.create_connection(address, timeout=CONNECT_TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(secret.encode("ascii"))
    sock.setblocking(False)
    return sock


class DirectStream:
    """One request's outputs, turned into chunks on the engine thread.

    Same rules as ``AsyncEngine.generate``: with ``stream_interval`` N,
    tokens after a choice's first go N at a time; the first token and the
    finish leave at once. ``done`` (a future on the replica's loop) ends with
    the number of chunks sent, or the error that ended the request.
    """

    def __init__(self, key: str, conn: SinkConnection, to_chunk: Callable[[RequestOutput], StreamChunk],
                 on_output: Callable[[RequestOutput], None], stream_interval: int = 1) -> None:
        self.key = key
        self.conn = conn
        self.loop = conn.loop
        self.done: asyncio.Future = self.loop.create_future()
        self.finished = False
        self.num_chunks = 0
        self._to_chunk = to_chunk
        self._on_output = on_output
        self._interval = stream_interval
        self._held: Optional[RequestOutput] = None
        self._sent_first: set[int] = set()
        with conn._lock:
            conn.streams.add(self)

    def put(self, item: Any) -> None:
        """Engine thread (or the loop, when the connection breaks): one output or error."""
        if self.finished:
            return
        if isinstance(item, BaseException):
            if self._held is not None:  # what was computed still reaches the client, then the error
                self._emit(self._held)
            self._end(item)
            return
        held = self._held
        if held is not None and held.index != item.index:  # outputs of one choice merge
            self._emit(held)
            held = None
        held = item if held is None else merge_outputs(held, item)
        self._held = held
        if chunk_due(held, self._sent_first, self._interval):
            self._emit(held)
            if held.finished:
                self._end(None)

    def detach(self) -> None:
        """The request is over (finished or cancelled): the connection forgets it."""
        self.finished = True
        with self.conn._lock:
            self.conn.streams.discard(self)

    def _emit(self, out: RequestOutput) -> None:
        self._held = None
        if out.new_token_ids:
            self._sent_first.add(out.index)
        self._on_output(out)
        self.conn.queue(self.key, self._to_chunk(out))
        self.num_chunks += 1

    def _end(self, error: Optional[BaseException]) -> None:
        self.finished = True
        self.conn.flush()  # the last chunk leaves before the reply does
        self.detach()
        if self.conn.broken is not None and error is None:
            error = DirectStreamError(f"the router at {self.conn.address[0]}:{self.conn.address[1]} went away")
        try:
            self.loop.call_soon_threadsafe(settle_future, self.done, self.num_chunks, error)
        except RuntimeError:  # the loop is closed: nobody waits
            pass


def chunk_of(out: RequestOutput, replica_id: str) -> StreamChunk:
    """The chunk a client gets for one of the engine's outputs."""
    return StreamChunk(
        request_id=out.request_id, token_ids=out.new_token_ids, text=out.new_text, finish_reason=out.finish_reason,
        logprobs=out.new_logprobs, prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
        cached_prompt_tokens=out.num_cached_tokens, replica_id=replica_id, prompt_logprobs=out.prompt_logprobs,
        index=out.index, more_choices=out.more_choices)
