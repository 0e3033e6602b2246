"""Where the time to first token goes, for ``bench serve`` on a local cluster.

A replica times each request from receiving it to its first token
(``prefixserve:time_to_first_token_seconds``) and, inside that, from entering
its engine to being scheduled (``request_queue_time_seconds``); it publishes
those histograms with every directory heartbeat. Read before and after the
run, their sums and counts give the replicas' mean TTFT over exactly the
run's requests, which is set against the client's mean TTFT::

    client TTFT = path + replica TTFT
    path        = the client's request to the router, the router's work
                  (tokenize, directory lookup, policy), Serve's dispatch to
                  the replica, and the first token's way back
    replica TTFT = queue (waiting for a step) + the prefill's steps

and the replicas' mean inter-token latency (``inter_token_latency_seconds``,
timed where the replica's engine thread hands each output on), to set
against the client's ITL the same way.

Means, not medians: histograms keep sums, not samples.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Sequence

NAMES = {"ttft": "prefixserve:time_to_first_token_seconds", "queue": "prefixserve:request_queue_time_seconds",
         "itl": "prefixserve:inter_token_latency_seconds"}
Snapshot = dict[str, tuple[float, float]]  # {"ttft" | "queue" | "itl": (sum of seconds, count)}


def parse(texts: Sequence[Any]) -> Snapshot:
    """Sums and counts of the two histograms over replicas' exposition texts."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {key: [0.0, 0.0] for key in NAMES}
    for text in texts:
        text = text.decode() if isinstance(text, bytes) else text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                for key, name in NAMES.items():
                    if sample.name == name + "_sum":
                        out[key][0] += sample.value
                    elif sample.name == name + "_count":
                        out[key][1] += sample.value
    return {key: (total, count) for key, (total, count) in out.items()}


async def texts(directories: Sequence[Any]) -> list[str]:
    """The live replicas' exposition texts, over every directory (one per served model)."""
    out: list[str] = []
    for directory in directories:
        out += [t.decode() if isinstance(t, bytes) else t for t in (await directory.replica_metrics()).values()]
    return out


async def snapshot(directories: Sequence[Any]) -> Snapshot:
    """The replicas' histograms now."""
    return parse(await texts(directories))


async def settled(directories: Sequence[Any], heartbeat_s: float = 1.5, timeout_s: float = 10.0,
                  read: Callable[[Sequence[Any]], Awaitable[Any]] = snapshot) -> Any:
    """``read(directories)`` (the histograms by default) once it did not move over more
    than a heartbeat: every request sent before (the warm-up, an earlier run's last
    ones) is counted, and none after; at ``timeout_s``, the last reading."""
    deadline = time.monotonic() + timeout_s
    last = await read(directories)
    while True:
        await asyncio.sleep(heartbeat_s)
        now = await read(directories)
        if now == last or time.monotonic() > deadline:
            return now
        last = now


async def after_run(directories: Sequence[Any], before: Snapshot, num_requests: int,
                    timeout_s: float = 10.0) -> Snapshot:
    """The histograms once every request of the run is counted (a replica publishes
    with its heartbeat, about a second late), or whatever is there at ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = await snapshot(directories)
        if now["ttft"][1] - before["ttft"][1] >= num_requests or time.monotonic() > deadline:
            return now
        await asyncio.sleep(0.25)


def split(before: Snapshot, after: Snapshot, client_ttft_mean_ms: float) -> dict[str, float]:
    """The run's TTFT split (module doc), in ms; empty when no replica counted a request."""
    count = after["ttft"][1] - before["ttft"][1]
    if count <= 0:
        return {}
    replica = 1000.0 * (after["ttft"][0] - before["ttft"][0]) / count
    queued = after["queue"][1] - before["queue"][1]
    queue = 1000.0 * (after["queue"][0] - before["queue"][0]) / queued if queued > 0 else 0.0
    gaps = after["itl"][1] - before["itl"][1]
    itl = 1000.0 * (after["itl"][0] - before["itl"][0]) / gaps if gaps > 0 else 0.0
    return {"requests": count, "client_ttft_mean_ms": client_ttft_mean_ms, "replica_ttft_mean_ms": replica,
            "replica_queue_mean_ms": queue, "path_mean_ms": client_ttft_mean_ms - replica,
            "replica_itl_mean_ms": itl}


def rows(parts: dict[str, float]) -> list[tuple[str, str]]:
    """Lines of ``bench serve``'s table."""
    return [
        ("TTFT mean at the replicas (ms):", f"{parts['replica_ttft_mean_ms']:.1f}"),
        ("  of which queued for a step (ms):", f"{parts['replica_queue_mean_ms']:.1f}"),
        ("TTFT mean, path (client - replicas, ms):", f"{parts['path_mean_ms']:.1f}"),
        ("ITL mean at the replicas (ms):", f"{parts.get('replica_itl_mean_ms', 0.0):.1f}"),
    ]


def merge(splits: Sequence[dict[str, float]]) -> dict[str, float]:
    """Several runs' splits as one: each mean weighted by its run's requests."""
    total = sum(s["requests"] for s in splits)
    out = {"requests": total}
    for key in splits[0]:
        if key != "requests":
            out[key] = sum(s[key] * s["requests"] for s in splits) / total
    return out
