"""The engine thread's bookkeeping: where its time goes (``LoopTiming``), the
retry hint an overloaded replica gives (``retry_hint``), its OS thread's name
and the futures it settles on the callers' loops."""

from __future__ import annotations

import asyncio
from typing import Optional

# Recent completions the retry hint is estimated from, and its bounds (seconds).
RETRY_HINT_WINDOW = 32
RETRY_HINT_DEFAULT_S = 1.0
RETRY_HINT_MIN_S = 0.05
RETRY_HINT_MAX_S = 30.0


def retry_hint(finish_times: list[float], now: float) -> float:
    """Seconds until a slot is likely to free: the mean gap between the recent
    completions (``finish_times``, oldest first), or the time since the last
    one when that is longer (the replica has slowed); ``RETRY_HINT_DEFAULT_S``
    without two completions. Clamped to [RETRY_HINT_MIN_S, RETRY_HINT_MAX_S]."""
    if len(finish_times) < 2:
        return RETRY_HINT_DEFAULT_S
    gap = (finish_times[-1] - finish_times[0]) / (len(finish_times) - 1)
    gap = max(gap, now - finish_times[-1])
    return min(max(gap, RETRY_HINT_MIN_S), RETRY_HINT_MAX_S)


class LoopTiming:
    """Where the engine thread's time goes, summed over its steps (read from
    any thread; floats replaced whole): ``step_s`` in ``engine.step()``,
    ``deliver_s`` handing outputs to the streams and the after-step hook
    (KV events, metrics), ``gap_s`` between the end of one step's work and
    the start of the next while requests ran (inbox, stats, waiting for the GIL)."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.step_s = 0.0
        self.deliver_s = 0.0
        self.gap_s = 0.0
        self._last_end: Optional[float] = None

    def add(self, began: float, stepped: float, ended: float) -> None:
        if self._last_end is not None and began - self._last_end < 1.0:  # not an idle wait
            self.gap_s += began - self._last_end
        self._last_end = ended
        self.num_steps += 1
        self.step_s += stepped - began
        self.deliver_s += ended - stepped

    def as_dict(self) -> dict[str, float]:
        return {"num_steps": self.num_steps, "step_s": self.step_s, "deliver_s": self.deliver_s, "gap_s": self.gap_s}


def name_os_thread(name: str) -> None:
    """Names the calling OS thread (Linux, 15 characters), as ``top -H``, ``ps -L``,
    py-spy and ``/proc/<pid>/task/*/comm`` show it; threads it starts later (OpenMP's
    pool) inherit the name. Does nothing where ``prctl`` is missing."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def settle_future(future: asyncio.Future, result: object, error: Optional[BaseException]) -> None:
    """Ends ``future`` with ``error`` or ``result`` unless it already ended (a cancelled
    caller); run on the future's loop (``call_soon_threadsafe`` from the engine thread)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
