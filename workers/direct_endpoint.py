"""``ReplicaServer.generate_direct``: a request whose chunks the engine thread
sends to the router itself (``workers/engine/direct_stream.py``, the
``direct`` replica transport). Mixed in, so the replica's module stays about
serving."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from cluster.shared.types import GenerationRequest
from workers.engine.direct_stream import DirectStream, SinkConnections, chunk_of


class DirectStreamEndpoint:
    """The direct transport's method; the class sets ``_sinks``, ``_front``,
    ``_ttft`` and ``replica_id`` and has ``_start_request``."""

    _sinks: SinkConnections
    _front: Any
    _ttft: Any
    replica_id: str
    _start_request: Callable[[GenerationRequest], Awaitable[Any]]  # the replica's: adapter read, metrics timer

    async def generate_direct(self, request: GenerationRequest, sink: tuple[str, int, str], key: str) -> int:
        """Runs the request, its chunks sent by the engine thread to the router's
        sink ``(host, port, secret)`` tagged with ``key``; returns how many were
        sent, when it ends (``workers/engine/direct_stream.py``).

        Raises:
            ValueError: The request is invalid (says what to change).
            ConnectionError: The router's sink cannot be reached, or went away.
        """
        timer = await self._start_request(request)
        conn = await self._sinks.get(*sink)
        request_id = request.request_id

        def on_output(out: Any) -> None:  # engine thread
            if out.new_token_ids:
                self._ttft.first_token(request_id)
            timer.on_output(out)

        stream = DirectStream(key, conn, lambda out: chunk_of(out, self.replica_id), on_output,
                              self._front.stream_interval)
        self._ttft.start(request_id)
        try:
            return await self._front.run_direct(request, stream)
        finally:
            self._ttft.discard(request_id)
