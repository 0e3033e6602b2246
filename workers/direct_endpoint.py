"""``ReplicaServer.generate_direct``: a request whose chunks the engine thread
sends to the router itself (``workers/engine/direct_stream.py``, the
``direct`` replica transport). Mixed in, so the replica's module stays about
serving."""

from __future__ import annotations

import asyncio
from typing import Any

from cluster.shared.types import GenerationRequest
from workers.engine.direct_stream import DirectStream, SinkConnections, chunk_of


class DirectStreamEndpoint:
    """The direct transport's method; the class sets ``_sinks``, ``_front``,
    ``_ttft``, ``metrics``, ``engine`` and ``replica_id``."""

    _sinks: SinkConnections
    _front: Any
    _ttft: Any
    metrics: Any
    engine: Any
    replica_id: str

    async def generate_direct(self, request: GenerationRequest, sink: tuple[str, int, str], key: str) -> int:
        """Runs the request, its chunks sent by the engine thread to the router's
        sink ``(host, port, secret)`` tagged with ``key``; returns how many were
        sent, when it ends (``workers/engine/direct_stream.py``).

        Raises:
            ValueError: The request is invalid (says what to change).
            ConnectionError: The router's sink cannot be reached, or went away.
        """
        lora = request.lora_request
        if lora is not None and self.engine.lora is not None:
            await asyncio.to_thread(self.engine.lora.prefetch, lora)
        conn = await self._sinks.get(*sink)
        timer = self.metrics.start_request(lora_name=lora.lora_name if lora is not None else None)
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
