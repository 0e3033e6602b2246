"""``prefixserve status``: a table of the cluster's replicas.

    prefixserve status --url 127.0.0.1:50051
    prefixserve status --url 127.0.0.1:50051 --metrics-url http://127.0.0.1:8000/metrics --watch 2

Per live replica: KV-cache use, running / waiting sequences and cached blocks
from ``ListReplicas`` (the stats each replica sends with its directory
heartbeat), and the Ray node it runs on (a column when the replicas run on
several nodes, or on one that is not this machine's loopback). With
``--metrics-url`` (the router's cluster-wide ``GET /metrics``) also swapped
sequences, the prefix-cache hit rate (hit / queried prompt tokens since the
replica started) and, from the second frame of ``--watch`` on, prompt and
generated tokens/s over the refresh interval.
Figures a source does not give show as ``-``. ``--watch`` redraws every
SECONDS (default 2) until Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from cluster.client.table import format_table

logger = logging.getLogger(__name__)

PREFIX = "prefixserve:"
# Series read from /metrics, by the name this module uses for them.
_SERIES = {
    "swapped": "num_requests_swapped",
    "kv_use": "kv_cache_usage_perc",
    "running": "num_requests_running",
    "waiting": "num_requests_waiting",
    "hits": "prefix_cache_hits_total",
    "queries": "prefix_cache_queries_total",
    "prompt_tokens": "prompt_tokens_total",
    "generation_tokens": "generation_tokens_total",
    "preemptions": "num_preemptions_total",
    "weight_bytes": "model_weight_bytes",
    "spec_draft_tokens": "spec_decode_num_draft_tokens_total",
    "spec_accepted_tokens": "spec_decode_num_accepted_tokens_total",
}
_INFO = PREFIX + "model_info"  # its quantization label is shown


@dataclass
class ReplicaRow:
    """What is known of one replica (None: not given by any source)."""

    replica_id: str
    model: str = ""
    node: str = ""  # the Ray node's IP address ("": not reported)
    kv_use: Optional[float] = None
    running: Optional[float] = None
    waiting: Optional[float] = None
    swapped: Optional[float] = None
    cached_blocks: Optional[int] = None
    hit_rate: Optional[float] = None
    metrics: dict[str, Any] = field(default_factory=dict)
    lora_adapters: tuple[str, ...] = ()  # the LoRA adapters it has loaded


def add_status_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="HOST:PORT of the cluster's gRPC router")
    parser.add_argument("--metrics-url", default=None,
                        help="the router's GET /metrics, e.g. http://127.0.0.1:8000/metrics (adds swapped, "
                             "hit rate, tokens/s)")
    parser.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                        help="redraw every SECONDS (default 2) until Ctrl-C")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds each query may take")
    parser.add_argument("--api-key", default=None, help="API key of a cluster started with --api-key")


def run_status(args: argparse.Namespace) -> int:
    """Prints the table once, or redraws it with ``--watch`` until Ctrl-C."""
    if args.watch is not None and not args.watch > 0:
        raise ValueError(f"--watch takes a positive number of seconds, got {args.watch}")
    try:
        return asyncio.run(_loop(args))
    except KeyboardInterrupt:
        return 0


async def _loop(args: argparse.Namespace) -> int:
    previous: Optional[tuple[float, dict[str, dict[str, float]]]] = None
    clear = args.watch is not None and sys.stdout.isatty()
    while True:
        rows = await fetch_rows(args.url, args.timeout, args.api_key)
        now = time.monotonic()
        if args.metrics_url:
            metrics = await fetch_metrics(args.metrics_url, args.timeout, args.api_key)
            merge_metrics(rows, metrics)
            rates = token_rates(previous, (now, metrics))
            previous = (now, metrics)
        else:
            rates = {}
        text = "\n".join(format_status(rows, rates, show_metrics=bool(args.metrics_url)))
        if clear:
            sys.stdout.write("\x1b[H\x1b[2J")
        print(text if args.watch is None else f"{time.strftime('%H:%M:%S')}  {args.url}\n{text}\n", flush=True)
        if args.watch is None:
            return 0
        await asyncio.sleep(args.watch)


async def fetch_rows(url: str, timeout: float, api_key: Optional[str] = None) -> dict[str, ReplicaRow]:
    """The replicas ``ListReplicas`` reports, by id.

    Raises:
        ValueError: The router is unreachable or answered an error (says which).
    """
    import grpc

    from router.pb import generation_pb2 as pb
    from router.pb import generation_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(url) as channel:
        try:
            metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
            reply = await pb_grpc.GenerationStub(channel).ListReplicas(pb.ListReplicasRequest(), timeout=timeout,
                                                                      metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            raise ValueError(f"ListReplicas on {url} failed: {exc.code().name}: {exc.details()}") from None
    return {
        r.replica_id: ReplicaRow(r.replica_id, model=r.model, node=r.node, kv_use=r.kv_cache_usage, running=r.num_running,
                                 waiting=r.num_waiting, cached_blocks=r.num_cached_blocks, swapped=r.num_swapped,
                                 hit_rate=r.prefix_cache_hit_rate, lora_adapters=tuple(r.lora_adapters))
        for r in reply.replicas
    }


async def fetch_metrics(url: str, timeout: float, api_key: Optional[str] = None) -> dict[str, dict[str, float]]:
    """``{replica: {name: value}}`` of the ``prefixserve:`` series ``url`` serves (summed over other labels).

    Raises:
        ValueError: The URL is unreachable or does not answer 200.
    """
    import aiohttp

    try:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout), headers=headers) as session:
            async with session.get(url) as response:
                if response.status != 200:
                    raise ValueError(f"GET {url} answered HTTP {response.status}: check --metrics-url")
                text = await response.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise ValueError(f"GET {url} failed: {type(exc).__name__}: {exc}") from None
    return parse_metrics(text)


def parse_metrics(text: str) -> dict[str, dict[str, Any]]:
    """Per-replica sums of the series ``status`` shows, from Prometheus text
    (and ``quantization``: the label of ``model_info``)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {PREFIX + series: name for name, series in _SERIES.items()}
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = wanted.get(sample.name)
            replica = sample.labels.get("replica")
            if sample.name == _INFO and replica:
                out.setdefault(replica, {})["quantization"] = sample.labels.get("quantization", "none")
                continue
            if name is None or not replica:
                continue
            per = out.setdefault(replica, {})
            per[name] = per.get(name, 0.0) + float(sample.value)
    return out


def merge_metrics(rows: dict[str, ReplicaRow], metrics: dict[str, dict[str, float]]) -> None:
    """Adds ``/metrics`` figures to the rows (replicas only there get rows too). Mutates ``rows``."""
    for replica, values in metrics.items():
        row = rows.setdefault(replica, ReplicaRow(replica))
        row.metrics = values
        row.swapped = values.get("swapped", row.swapped)
        for name in ("kv_use", "running", "waiting"):
            if getattr(row, name) is None and name in values:
                setattr(row, name, values[name])


def token_rates(previous: Optional[tuple[float, dict[str, dict[str, float]]]],
                current: tuple[float, dict[str, dict[str, float]]]) -> dict[str, tuple[float, float]]:
    """``{replica: (prompt tokens/s, generated tokens/s)}`` between two scrapes (empty on the first)."""
    if previous is None:
        return {}
    (t0, before), (t1, after) = previous, current
    seconds = t1 - t0
    if seconds <= 0:
        return {}
    rates = {}
    for replica, values in after.items():
        old = before.get(replica)
        if old is None:
            continue
        # A counter that went down means the replica restarted: count from zero.
        deltas = [values.get(k, 0.0) - old.get(k, 0.0) for k in ("prompt_tokens", "generation_tokens")]
        deltas = [d if d >= 0 else values.get(k, 0.0) for d, k in zip(deltas, ("prompt_tokens", "generation_tokens"))]
        rates[replica] = (deltas[0] / seconds, deltas[1] / seconds)
    return rates


def format_status(rows: dict[str, ReplicaRow], rates: dict[str, tuple[float, float]],
                  show_metrics: bool) -> list[str]:
    """The table (one line per replica, then a total line)."""
    if not rows:
        return ["no live replicas"]
    by_model = len({r.model for r in rows.values()}) > 1  # several models: a column names each one's
    nodes = {r.node for r in rows.values()} - {""}
    by_node = len(nodes) > 1 or bool(nodes - {"127.0.0.1"})  # on several nodes, or not this machine's loopback
    header = ["replica", *(["model"] if by_model else []), *(["node"] if by_node else []), "KV use", "running", "waiting", "swapped", "cached blocks", "hit rate"]
    speculating = show_metrics and any(r.metrics.get("spec_draft_tokens") for r in rows.values())
    if show_metrics:
        header += ["prompt tok/s", "gen tok/s", "quantization", "weights"]
    if speculating:
        header += ["spec accept"]  # accepted / proposed tokens since the replica started
    with_lora = any(r.lora_adapters for r in rows.values())
    if with_lora:
        header += ["LoRA adapters"]
    table: list[tuple[str, ...]] = [tuple(header)]
    for replica_id in sorted(rows, key=lambda rid: (rows[rid].model, rid)):
        row = rows[replica_id]
        line = [replica_id, *([row.model] if by_model else []), *([row.node or "-"] if by_node else []),
                _pct(row.kv_use), _int(row.running), _int(row.waiting), _int(row.swapped),
                _int(row.cached_blocks)]
        queries, hits = row.metrics.get("queries"), row.metrics.get("hits")
        line.append(_pct(hits / queries) if queries else _pct(row.hit_rate))
        if show_metrics:
            rate = rates.get(replica_id)
            line += [f"{rate[0]:.1f}", f"{rate[1]:.1f}"] if rate else ["-", "-"]
            weights = row.metrics.get("weight_bytes")
            line += [row.metrics.get("quantization", "-"), f"{weights / 2**20:.0f} MiB" if weights else "-"]
        if speculating:
            drafted = row.metrics.get("spec_draft_tokens")
            line.append(_pct(row.metrics.get("spec_accepted_tokens", 0.0) / drafted) if drafted else "-")
        if with_lora:
            line.append(",".join(row.lora_adapters) or "-")
        table.append(tuple(line))
    lines = format_table(table)
    running = sum(r.running or 0 for r in rows.values())
    waiting = sum(r.waiting or 0 for r in rows.values())
    lines.append(f"{len(rows)} replica(s), {running:.0f} running, {waiting:.0f} waiting"
                 + (f", {sum(g for _, g in rates.values()):.1f} generated tok/s" if rates else ""))
    return lines


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1%}"


def _int(value: Optional[Any]) -> str:
    return "-" if value is None else f"{value:.0f}"
