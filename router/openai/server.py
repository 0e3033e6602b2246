"""Serving the OpenAI-compatible API with uvicorn inside an existing event
loop (the router's), on a socket bound before start-up so port 0 works.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any, Optional

import uvicorn

from router.backend import Backend
from router.limits import Limits
from router.openai.app import build_openai_app

logger = logging.getLogger(__name__)


class OpenAIServerHandle:
    """A running :func:`serve_openai` server.

    Attributes:
        host: The bound address.
        port: The bound port (the real one when 0 was asked).
    """

    def __init__(self, server: uvicorn.Server, task: asyncio.Task, host: str, port: int, tls: bool = False,
                 metrics: Any = None) -> None:
        self._server = server
        self._task = task
        self.host = host
        self.port = port
        self.tls = tls
        self.metrics = metrics  # ClusterMetrics: its exporter lease is released on stop

    @property
    def url(self) -> str:
        """Base URL of the API, e.g. ``http://127.0.0.1:8000/v1`` (``https`` with TLS)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/v1"

    @property
    def running(self) -> bool:
        """Whether the server task is still serving."""
        return not self._task.done()

    async def stop(self, grace: Optional[float] = None) -> None:
        """Stops accepting requests, lets running ones (streams too) finish, and returns when closed.

        Args:
            grace: Seconds running requests get before they are cut; None
                keeps the server's setting (5 s).
        """
        if grace is not None:
            self._server.config.timeout_graceful_shutdown = grace
        self._server.should_exit = True
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        release = getattr(self.metrics, "release", None)
        if release is not None:
            await release()  # the replicas' series move to another router now


class _EmbeddedServer(uvicorn.Server):
    """uvicorn in someone else's event loop: leaves the process's signal handlers alone."""

    def capture_signals(self):  # type: ignore[override]
        import contextlib

        return contextlib.nullcontext()


async def serve_openai(backend: Backend, host: str = "127.0.0.1", port: int = 8000,
                       metrics: Any = None, *, limits: Optional[Limits] = None,
                       security: Any = None) -> OpenAIServerHandle:
    """Serves the OpenAI API with uvicorn in the current event loop.

    Args:
        backend: The request backend.
        host: Address to bind (loopback by default).
        port: Port to bind; 0 picks a free one (see ``handle.port``).
        metrics: Serves ``GET /metrics`` (``router.metrics.ClusterMetrics``).
        limits: Input limits and body size (default ``Limits()``).
        security: ``router.security.Security``: HTTPS with its TLS files
            (client certificates required with a client CA) and API keys.

    Returns:
        A handle with ``.port`` and ``async stop()``.

    Raises:
        OSError: The address cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    bound = sock.getsockname()[1]
    tls = security.tls if security is not None else None
    config = uvicorn.Config(
        build_openai_app(backend, metrics, limits=limits, security=security), lifespan="off",
        log_level="warning", access_log=False, timeout_graceful_shutdown=5,
        **(tls.uvicorn_options() if tls is not None else {}),
    )
    server = _EmbeddedServer(config)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            sock.close()
            task.result()  # raises the startup error
            raise RuntimeError("the OpenAI HTTP server exited during startup")
        await asyncio.sleep(0.01)
    handle = OpenAIServerHandle(server, task, host, bound, tls=tls is not None, metrics=metrics)
    logger.info("OpenAI-compatible API on %s", handle.url)
    return handle
