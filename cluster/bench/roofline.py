"""The weight-read roofline of a decode step, for ``bench latency`` and ``bench quant``.

At small batches a decode step must read every weight once; it can take no
less than ``bytes per step / read bandwidth``. The bandwidth is measured here,
in the same run as the steps it is set against (``measure_read_gbps``: the best
of a few sums over a buffer far larger than the caches, on the benchmark's
threads), once per round, because this machine's speed drifts by 10-40% from
minute to minute: a floor from another minute would mean little. A step's
fraction of the roofline is ``floor / step``: 1.0 reads the weights at the
measured rate and does nothing else.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional

BUFFER_MIB = 256  # far beyond the L3 of the CPUs here (32 MiB)
REPEATS = 3


def measure_read_gbps(buffer_mib: int = BUFFER_MIB, repeats: int = REPEATS,
                      clock: Callable[[], float] = time.perf_counter) -> float:
    """The best read bandwidth of ``repeats`` sums over ``buffer_mib`` MiB (GB/s), on torch's threads.

    ``clock``: ``time.thread_time`` with torch on one thread measures the calling thread's CPU time,
    as a kernel timed the same way on a shared machine (``scripts/bench_qgemm.py --cpu-time``)."""
    import torch

    buf = torch.ones(buffer_mib * 2**20 // 4, dtype=torch.float32)
    best = 0.0
    for _ in range(repeats):
        begin = clock()
        float(buf.sum())
        best = max(best, buf.numel() * 4 / (clock() - begin) / 1e9)
    return round(best, 2)


def roofline(decode: dict[str, Any], weight_bytes: int, gbps: float, measured: bool,
             peer: Optional[tuple[dict[str, Any], int]] = None, gbps_rounds: Optional[list[float]] = None
             ) -> dict[str, Any]:
    """Each decode step against one read of ``weight_bytes`` at ``gbps``: the floor in ms and the fraction
    reached per batch size; ``peer``: llama.cpp's decode figures and its bytes per step, the same way."""
    floor_ms = weight_bytes / (gbps * 1e9) * 1e3
    out: dict[str, Any] = {"gbps": gbps, "measured": measured, "weight_bytes": weight_bytes,
                           "floor_ms": round(floor_ms, 4),
                           "fraction": {batch: round(floor_ms / fig["step_ms"], 3) for batch, fig in decode.items()}}
    if gbps_rounds:
        out["gbps_rounds"] = gbps_rounds
    if peer is not None:
        peer_decode, peer_bytes = peer
        peer_floor = peer_bytes / (gbps * 1e9) * 1e3
        out["peer"] = {"weight_bytes": peer_bytes, "floor_ms": round(peer_floor, 4),
                       "fraction": {b: round(peer_floor / fig["step_ms"], 3) for b, fig in peer_decode.items()}}
    return out


def median_gbps(rounds: list[float]) -> float:
    return round(statistics.median(rounds), 2)


def step_cell(line: Optional[dict[str, Any]], batch: str) -> str:
    """The roofline cell of a step row: ``floor 4.12 ms: 63% (llama.cpp 3.80 ms: 41%)``."""
    if not line or batch not in line["fraction"]:
        return ""
    cell = f"floor {line['floor_ms']:.2f} ms: {line['fraction'][batch]:.0%}"
    peer = line.get("peer")
    if peer and batch in peer["fraction"]:
        cell += f" (llama.cpp {peer['floor_ms']:.2f} ms: {peer['fraction'][batch]:.0%})"
    return cell


def summary(line: dict[str, Any]) -> str:
    """One line under the table: where the floor comes from."""
    rate = (f"{line['gbps']:.1f} GB/s measured in this run (median of rounds: "
            + ", ".join(f"{g:.1f}" for g in line.get("gbps_rounds", [line["gbps"]])) + ")"
            if line["measured"] else f"{line['gbps']:.1f} GB/s (given)")
    text = f"roofline: {line['weight_bytes'] / 1e6:.1f} MB of weights a step over {rate}"
    if "peer" in line:
        text += f"; llama.cpp's file {line['peer']['weight_bytes'] / 1e6:.1f} MB"
    return text
