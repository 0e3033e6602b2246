"""Draining a router replica on request: what a router pod's ``preStop`` hook runs.

In Kubernetes the router is a Serve deployment inside a Ray worker pod, whose
main process is ``ray start --block``: SIGTERM to the pod would take the
router's streams down with Ray. So the pod's ``preStop`` hook runs, before
the SIGTERM::

    prefixserve router-drain --socket /tmp/prefixserve-router.sock --timeout 40

which asks the router replica in that pod, over a Unix socket only processes
of the pod can open (``router.admin_socket``), to drain:

1. health turns NOT_SERVING (gRPC ``grpc.health.v1``, HTTP ``/health`` 503),
   so the readiness probe fails and the Services stop sending new calls;
2. new requests that still arrive get UNAVAILABLE / 503 ("draining: retry"),
   which clients retry on another router;
3. running streams finish, for up to the timeout;

and returns once no stream is left (exit 0) or at the timeout (exit 1, with
the number still running). Only then does Kubernetes send SIGTERM, so
``terminationGracePeriodSeconds`` must exceed the hook's timeout.

The protocol is one line each way: ``drain <timeout_s>\\n`` in,
``drained <streams left>\\n`` out.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Awaitable, Callable, Optional

logger = logging.getLogger(__name__)

DEFAULT_SOCKET = "/tmp/prefixserve-router.sock"
MAX_LINE = 64


class DrainControl:
    """The router side: a Unix socket server that runs ``drain(timeout_s)`` on request.

    Args:
        path: The socket's path (created with mode 0600; a stale one is replaced).
        drain: Drains the router for at most ``timeout_s`` seconds; returns
            the streams still running.
    """

    def __init__(self, path: str, drain: Callable[[float], Awaitable[int]]) -> None:
        self.path = path
        self.drain = drain
        self._server: Optional[asyncio.AbstractServer] = None

    async def start(self) -> None:
        """Listens on ``path``.

        Raises:
            RuntimeError: The socket cannot be created (the message names the path).
        """
        try:
            if os.path.exists(self.path):
                os.unlink(self.path)  # a previous replica's socket
            old_umask = os.umask(0o177)
            try:
                self._server = await asyncio.start_unix_server(self._serve, path=self.path)
            finally:
                os.umask(old_umask)
        except OSError as exc:
            raise RuntimeError(f"cannot create the router's admin socket {self.path}: {exc.strerror or exc} "
                               "(router.admin_socket)") from exc
        logger.info("router drain socket on %s", self.path)

    async def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = (await asyncio.wait_for(reader.readline(), 10))[:MAX_LINE].decode("ascii", "replace").split()
            if len(line) != 2 or line[0] != "drain":
                writer.write(b"error: send 'drain <timeout_s>'\n")
                return
            try:
                timeout_s = float(line[1])
            except ValueError:
                timeout_s = -1.0
            if not 0 <= timeout_s <= 24 * 3600:
                writer.write(b"error: the timeout must be a number of seconds in 0..86400\n")
                return
            logger.info("drain requested over %s: up to %.0f s for running streams", self.path, timeout_s)
            left = await self.drain(timeout_s)
            writer.write(f"drained {left}\n".encode())
        except (asyncio.TimeoutError, ConnectionError) as exc:
            logger.info("drain socket: a client went away (%s)", exc)
        finally:
            try:
                await writer.drain()
                writer.close()
            except ConnectionError:
                pass


async def request_drain(path: str, timeout_s: float) -> int:
    """The client side: asks the router behind ``path`` to drain; returns the
    streams left running when it finished.

    Raises:
        RuntimeError: No router listens there, or it answered an error.
    """
    try:
        reader, writer = await asyncio.open_unix_connection(path)
    except OSError as exc:
        raise RuntimeError(f"no router listens on {path} ({exc.strerror or exc}): is router.admin_socket "
                           "set to this path?") from exc
    try:
        writer.write(f"drain {timeout_s:g}\n".encode())
        await writer.drain()
        reply = (await asyncio.wait_for(reader.readline(), timeout_s + 30)).decode("ascii", "replace").strip()
    finally:
        writer.close()
    kind, _, value = reply.partition(" ")
    if kind != "drained" or not value.isdigit():
        raise RuntimeError(f"the router on {path} answered {reply!r}")
    return int(value)
