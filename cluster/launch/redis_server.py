"""A real ``redis-server`` on a loopback port, for the local launcher and tests.

By default the server keeps nothing on disk (``--save "" --appendonly no``):
the prefix directory is a cache of what replicas hold, and replicas rebuild it
with a resync after a Redis restart (see docs/DIRECTORY.md). With ``data_dir``
it keeps an append-only file there (``appendfsync everysec``: a crash loses at
most the last second; a stop loses nothing), so stored Responses API
responses survive a restart of the server; the directory's keys come back too,
and every replica rebuilds its own anyway after the outage (a Redis error
marks its publisher for a resync), so none is trusted stale. Big per-replica sets are
freed in a background thread (``lazyfree-*``) so an expiring dead replica or a
resync never stalls lookups.

    with RedisServer() as server:          # free port, waits for PING
        directory = Directory.from_url(server.url)
        ...
        server.stop(); server.start()      # same port, empty data: a Redis restart

    with RedisServer(data_dir=path) as server:  # the keys outlive stop() / restart()

``start()`` blocks (tens of milliseconds); call it before the event loop runs
or from a worker thread.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, Sequence

import redis

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "install it (`apt-get install -y redis-server`, or your platform's redis package) "
    "or point prefixserve at an existing Redis with --redis-url"
)


class RedisServerNotFound(RuntimeError):
    """The ``redis-server`` binary is not installed."""


class RedisServerError(RuntimeError):
    """``redis-server`` did not start (or did not answer PING in time)."""


def find_free_port(host: str = "127.0.0.1") -> int:
    """Returns a port nothing listens on right now (another process may take
    it before we bind: ``RedisServer.start`` retries on that race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _find_binary(binary: Optional[str]) -> str:
    path = shutil.which(binary or "redis-server")
    if path is None:
        raise RedisServerNotFound(f"{binary or 'redis-server'} was not found on PATH: {INSTALL_HINT}")
    return path


class RedisServer:
    """One ``redis-server`` process bound to ``host`` (loopback by default).

    Args:
        port: Port to listen on; None picks a free one on the first start.
            Later starts reuse the same port (a restart keeps the URL).
        password: Sets ``requirepass``; it is part of ``url``.
        host: Address to bind; keep the default outside tests of remote setups.
        binary: Name or path of the server binary.
        extra_args: More ``--option value`` arguments for the server.
        startup_timeout_s: How long ``start()`` waits for PING.
        data_dir: A folder (made if missing) where the server persists its keys
            in an append-only file and that ``stop()`` keeps; None: a temporary
            folder, no persistence, deleted on ``stop()``.
    """

    def __init__(
        self,
        port: Optional[int] = None,
        password: Optional[str] = None,
        host: str = "127.0.0.1",
        binary: Optional[str] = None,
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = 10.0,
        data_dir: Optional[Path] = None,
    ) -> None:
        self._binary = _find_binary(binary)  # fail at construction, before anything starts
        self.host = host
        self.port = port
        self.password = password
        self.extra_args = tuple(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self._proc: Optional[subprocess.Popen] = None
        self._data_dir: Optional[Path] = None
        self._fixed_port = port is not None
        self.persist_dir = Path(data_dir) if data_dir is not None else None

    # ---------------------------------------------------------------- figures
    @property
    def url(self) -> str:
        """``redis://[:password@]host:port/0``; valid once a port is chosen."""
        if self.port is None:
            raise RuntimeError("the server has no port yet: call start() first")
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc is not None else None

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -------------------------------------------------------------- lifecycle
    def start(self) -> "RedisServer":
        """Starts the server and waits until it answers PING (blocks).

        Returns:
            self, for chaining.

        Raises:
            RedisServerError: It exited or did not answer in time; the message
                carries the tail of its log.
        """
        if self.is_running:
            return self
        attempts = 1 if self._fixed_port else 3  # a picked port may be taken meanwhile
        for attempt in range(attempts):
            if self.port is None or (attempt > 0 and not self._fixed_port):
                self.port = find_free_port(self.host)
            try:
                self._spawn_and_wait()
                logger.info("redis-server pid %d listening on %s:%d", self.pid, self.host, self.port)
                return self
            except RedisServerError as exc:
                if attempt == attempts - 1 or "Address already in use" not in str(exc):
                    raise
                logger.warning("redis-server failed on port %d, retrying on another port", self.port)
        raise AssertionError("unreachable")

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops the server (SIGTERM, then SIGKILL after ``timeout_s``) and
        deletes its data folder (not a ``data_dir``). Safe to call twice;
        ``start()`` brings it back on the same port, empty unless it persists."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("redis-server pid %d ignored SIGTERM; killing it", proc.pid)
                proc.kill()
                proc.wait(timeout_s)
        if self._data_dir is not None and self.persist_dir is None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
        self._data_dir = None

    def restart(self) -> "RedisServer":
        """Stops and starts again on the same port; every key is lost unless
        the server persists (``data_dir``)."""
        self._fixed_port = True
        self.stop()
        return self.start()

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def __del__(self) -> None:
        # A crashed test or launcher must not leave a server behind.
        if getattr(self, "_proc", None) is not None and self._proc.poll() is None:
            self._proc.kill()

    # ---------------------------------------------------------------- helpers
    def _command(self) -> list[str]:
        assert self._data_dir is not None and self.port is not None
        args = [
            self._binary,
            "--bind", self.host,
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "yes" if self.persist_dir is not None else "no",
            "--appendfsync", "everysec",
            "--dir", str(self._data_dir),
            "--logfile", str(self._data_dir / "redis.log"),
            "--daemonize", "no",
            # Free big sets (an expired dead replica, a resync's RENAME) off the
            # main thread so lookups never wait behind them.
            "--lazyfree-lazy-expire", "yes",
            "--lazyfree-lazy-server-del", "yes",
            "--lazyfree-lazy-user-del", "yes",
        ]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        return args + list(self.extra_args)

    def _spawn_and_wait(self) -> None:
        if self.persist_dir is not None:
            self.persist_dir.mkdir(parents=True, exist_ok=True)
            self._data_dir = self.persist_dir.resolve()
        else:
            self._data_dir = Path(tempfile.mkdtemp(prefix="prefixserve-redis-"))
        # stderr goes to a file: errors before the log file opens (a bad flag)
        # land there, and nothing can fill a pipe nobody reads.
        with open(self._data_dir / "stderr.log", "wb") as stderr:
            self._proc = _popen_from_a_lasting_thread(
                self._command(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
                preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + self.startup_timeout_s
        client = redis.Redis(
            host=self.host, port=self.port, password=self.password, socket_connect_timeout=0.2, socket_timeout=0.5
        )
        try:
            while True:
                if self._proc.poll() is not None:
                    self._fail(f"redis-server exited with code {self._proc.returncode}")
                try:
                    if client.ping():
                        return
                except redis.AuthenticationError:
                    self._fail("redis-server rejected the password")
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    self._fail(f"redis-server did not answer PING within {self.startup_timeout_s:.0f} s")
                time.sleep(0.02)
        finally:
            client.close()

    def _fail(self, reason: str) -> None:
        log = ""
        for name in ("stderr.log", "redis.log"):
            path = self._data_dir / name if self._data_dir is not None else None
            if path is not None and path.exists():
                log += path.read_text(errors="replace")[-2000:]
        self.stop()
        raise RedisServerError(f"{reason} (port {self.port}); log tail:\n{log}")


# The one thread that forks redis-servers for callers that are not the main
# thread (see _popen_from_a_lasting_thread); it lives as long as the process.
_spawner: Optional[ThreadPoolExecutor] = None
_spawner_lock = threading.Lock()


def _popen_from_a_lasting_thread(*args: Any, **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen`` from a thread that lives as long as the process.

    ``PR_SET_PDEATHSIG`` (``_die_with_parent``) fires when the *thread* that
    forked the child exits, not the process: a server started from a worker
    thread (``asyncio.to_thread``, an executor, a launcher thread) would get
    SIGTERM as soon as that thread finished. The main thread and the one
    spawner thread here both last until the process ends.
    """
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(*args, **kwargs)
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="redis-spawner")
    return _spawner.submit(subprocess.Popen, *args, **kwargs).result()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the process that started it
    dies, even by SIGKILL or a crash, so no redis-server outlives its owner
    (Linux only; elsewhere ``stop()`` remains the way out)."""
    try:
        import ctypes
        import signal as _signal

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(_signal.SIGTERM), 0, 0, 0)
    except Exception:  # noqa: BLE001 - best effort, never block the start
        pass
