"""Replicas that share a machine's cores split them by who is busy.

Replicas packed on one machine that each reserve a fraction of a CPU used to
split its cores once, at start: two replicas on 2 cores computed on one
thread each, so a lone request (one busy replica, the other idle) ran at half
the engine's speed. Here each such replica holds a slot on a small board in
shared memory (one file per Ray node, ``/dev/shm`` where it exists) and
marks itself busy while it has requests; before every step it computes with
``cores // busy replicas`` threads (at least 1), so one busy replica takes
every core and two share them. The thread count never changes an output: the
kernels give each element the same arithmetic whatever the number of threads
(``tests/engine/test_core_share.py``).

A slot whose process is gone (killed mid-step, its busy mark left set) is
cleared by the next replica that looks (``os.kill(pid, 0)``, at most once a
second), so a crash costs the others at most a second of halved threads.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import struct
import tempfile
import time
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from cluster.shared.config import EngineConfig

logger = logging.getLogger(__name__)

SLOTS = 64
_SLOT = struct.Struct("<qq")  # (pid, busy)
_FLAG = struct.Struct("<q")
_BOARD = struct.Struct(f"<{2 * SLOTS}q")  # every slot in one read
SIZE = SLOTS * _SLOT.size
CHECK_DEAD_S = 1.0


def board_path(key: str) -> str:
    """The board's file for ``key`` (the Ray node): in ``/dev/shm`` when it exists."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in key)[:96]
    return os.path.join(folder, f"prefixserve-cores-{safe}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class CoreShare:
    """This process's slot on the board of ``path``, and the threads it may use.

    Args:
        path: The board's file (``board_path``); created if missing.
        cores: The machine's cores the replicas share.
        set_threads: Sets the forward's threads (torch's, on the calling
            thread, which must be the engine thread).
        max_threads: Most threads this replica uses (default ``cores``).
        pid: The process the slot is held for (default this one; tests).

    Raises:
        RuntimeError: Every slot is held by a live process.
    """

    def __init__(self, path: str, cores: int, set_threads: Callable[[int], None],
                 max_threads: Optional[int] = None, pid: Optional[int] = None) -> None:
        self.path = path
        self.cores = max(1, cores)
        self.max_threads = max(1, min(self.cores, max_threads or self.cores))
        self._set_threads = set_threads
        self._pid = pid or os.getpid()
        self._busy = False
        self._threads = 0  # applied so far (0: none yet)
        self._checked = 0.0
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.fstat(fd).st_size < SIZE:
                    os.ftruncate(fd, SIZE)
                self._map = mmap.mmap(fd, SIZE)
                self.slot = self._claim()
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        logger.info("sharing %d cores with the replicas of %s (slot %d)", self.cores, path, self.slot)

    def _claim(self) -> int:
        for i in range(SLOTS):
            pid, _ = _SLOT.unpack_from(self._map, i * _SLOT.size)
            if pid == 0 or not _alive(pid):
                _SLOT.pack_into(self._map, i * _SLOT.size, self._pid, 0)
                return i
        raise RuntimeError(f"{SLOTS} processes already share the cores of {self.path}")

    def busy_replicas(self) -> int:
        """Replicas now marked busy (this one included when it is)."""
        now = time.monotonic()
        check = now - self._checked >= CHECK_DEAD_S
        if check:
            self._checked = now
        board = _BOARD.unpack_from(self._map)  # pid, busy, pid, busy, ...
        busy = 0
        for i in range(SLOTS):
            if not board[2 * i + 1]:
                continue
            pid = board[2 * i]
            if check and pid != self._pid and (pid == 0 or not _alive(pid)):
                _FLAG.pack_into(self._map, i * _SLOT.size + 8, 0)  # a dead replica's mark
                continue
            busy += 1
        return busy

    def threads_for(self, busy: int) -> int:
        return max(1, min(self.max_threads, self.cores // max(1, busy)))

    def before_step(self) -> None:
        """Engine thread, before a step: marks this replica busy and sets its threads."""
        if not self._busy:
            _FLAG.pack_into(self._map, self.slot * _SLOT.size + 8, 1)
            self._busy = True
        threads = self.threads_for(self.busy_replicas())
        if threads != self._threads:
            self._set_threads(threads)
            self._threads = threads

    def idle(self) -> None:
        """Engine thread, before it waits for work: no longer busy."""
        if self._busy:
            _FLAG.pack_into(self._map, self.slot * _SLOT.size + 8, 0)
            self._busy = False

    @property
    def threads(self) -> int:
        """Threads of the last step (0 before the first)."""
        return self._threads

    def close(self) -> None:
        """Gives the slot back."""
        if getattr(self, "_map", None) is None:
            return
        try:
            _SLOT.pack_into(self._map, self.slot * _SLOT.size, 0, 0)
            self._map.close()
        except (ValueError, OSError):
            pass
        self._map = None


def torch_threads() -> int:
    """Threads the forward computes with (on the calling thread)."""
    import torch

    return torch.get_num_threads()


def _ray_actor_cpus() -> Optional[float]:
    """CPUs this Ray actor reserves; None outside a Ray worker."""
    try:
        import ray

        if not ray.is_initialized() or ray.get_runtime_context().worker.mode != ray.WORKER_MODE:
            return None
        return float(ray.get_runtime_context().get_assigned_resources().get("CPU", 0.0))
    except Exception:  # noqa: BLE001 - not in a Ray worker
        return None


def forward_threads(config: "EngineConfig", packed_replicas: int) -> Optional[int]:
    """Torch threads of this replica's forward at start: ``parallel.cpu_threads``,
    or picked from the CPUs this Ray actor reserves (``threads_per_rank``:
    whole CPUs, or the machine's cores split over the replicas that may share
    it, at most ``packed_replicas``). None outside a Ray actor (torch's
    default stays). Ray alone sets ``OMP_NUM_THREADS=1`` for a fractional actor."""
    if config.parallel.cpu_threads is not None:
        return config.parallel.cpu_threads
    num_cpus = _ray_actor_cpus()
    if not num_cpus or num_cpus <= 0:
        return None
    from workers.placement import machine_cores, threads_per_rank

    cores = machine_cores()
    sharing = min(max(1, packed_replicas), max(1, int(cores / num_cpus)))
    return threads_per_rank(num_cpus, sharing, cores)


def core_share_for(config: "EngineConfig", packed_replicas: int) -> Optional[CoreShare]:
    """A ``CoreShare`` for a replica that computes its forward itself on a
    fraction of a CPU beside others that may share the machine (``packed_replicas``
    > 1); None where its threads stay fixed: ``parallel.cpu_threads`` set,
    whole CPUs reserved, tensor-parallel ranks, or outside a Ray actor."""
    if config.parallel.cpu_threads is not None or packed_replicas <= 1 or config.device == "cuda" \
            or config.parallel.tensor_parallel_size > 1:
        return None
    import torch

    if config.device is None and torch.cuda.is_available():
        return None
    num_cpus = _ray_actor_cpus()
    if num_cpus is None or num_cpus <= 0 or num_cpus >= 1:
        return None
    import ray

    from workers.placement import machine_cores, set_cpu_threads

    try:
        return CoreShare(board_path(ray.get_runtime_context().get_node_id()), machine_cores(), set_cpu_threads)
    except (OSError, RuntimeError) as exc:
        logger.warning("threads stay fixed: no core-share board (%s)", exc)
        return None
