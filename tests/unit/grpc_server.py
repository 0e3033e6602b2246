"""A real ``RouterServer`` on a free loopback port, in an event loop on its own
thread, for the unit tests of the gRPC front end over a fake backend."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, Iterator

from router.server import RouterServer


@contextlib.contextmanager
def serving_grpc(backend: Any) -> Iterator[str]:
    """Serves ``backend`` over gRPC until the block ends; yields ``host:port``."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = RouterServer(backend, port=0)
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    try:
        yield server.address
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
