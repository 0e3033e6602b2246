"""``prefixserve up`` run as a user runs it: a child process whose log the
tests read."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Iterator, Optional


def start_up(log_path: Path, *args: str, stdout: Optional[int] = subprocess.DEVNULL,
             env: Optional[dict[str, str]] = None) -> tuple[subprocess.Popen, IO]:
    """Starts ``python -m cluster.cli up *args`` logging to ``log_path``; returns the process and its log."""
    log = open(log_path, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "up", *args], stdout=stdout, stderr=log, text=True,
                            env=env)
    return proc, log


def wait_for_log(proc: subprocess.Popen, log: IO, needle: str, timeout_s: float = 300) -> str:
    """The whole log once ``needle`` is in it; fails if the process exits or time runs out first."""
    deadline = time.monotonic() + timeout_s
    text = ""
    while needle not in text:
        assert time.monotonic() < deadline and proc.poll() is None, text[-3000:]
        time.sleep(0.5)
        log.seek(0)
        text = log.read()
    return text


def stop_up(proc: subprocess.Popen, log: IO, timeout_s: float = 120) -> None:
    """SIGTERM (``up`` drains and stops everything it started), SIGKILL if it hangs; closes the log.
    Nothing to signal when it already exited (a test that stopped it itself)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    log.close()


@contextlib.contextmanager
def running_up(log_path: Path, *args: str, env: Optional[dict[str, str]] = None,
               ready: str = "ready: gRPC on") -> Iterator[tuple[subprocess.Popen, str]]:
    """``up *args`` until the block ends: yields the process and its log once ``ready`` is in it."""
    proc, log = start_up(log_path, *args, env=env)
    try:
        yield proc, wait_for_log(proc, log, ready)
    finally:
        stop_up(proc, log)
