"""The fault table of the note: each fault injected for real on a local
cluster, with load driven through the gRPC router (``grpc.aio``).

Rows (``--scenarios``, in this order; ``redis`` and ``kill`` share one
2-replica cluster on a ``redis-server`` of the script's own, so it can be
stopped and started again on the same port; ``flood`` and ``kv`` get a
1-replica cluster each):

    redis  redis-server SIGKILLed under load (requests keep coming), started
           again empty on the same port ``--outage-s`` later.
    kill   SIGKILL of a replica's process while >= 8 greedy streams run on
           it; every stream must end token-identical to an undisturbed run.
    flood  one replica (max_num_seqs 2, max_waiting_requests 2) flooded:
           the excess gets RESOURCE_EXHAUSTED with retry-after-ms; refused
           clients retry after the hint.
    kv     a tiny KV pool (--kv-blocks) under concurrent long requests: all
           complete, token-identical to a one-at-a-time run, preemptions > 0.

Columns: requests in flight at the fault; requests lost (an accepted request
that ended with neither a finish reason nor an expected clear error: must be
0); clear errors returned; time to recover (defined per row in ``CAPTION``).
The clients of each row are in ``scripts/fault_scenarios.py``.
Prints a markdown table, writes JSON (``--json``). Bounded: stops itself
after ``--time-limit-s`` (rows not reached are left out, a scenario cut short
is a failed row); exit status 1 when any row failed its check.

    unshare --net bash -c 'ip link set lo up; export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0; \\
        python scripts/fault_table.py'                 # the default model
    ... python scripts/fault_table.py --model tiny     # a random-init tiny llama: a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cluster.shared.config import ClusterConfig, EngineConfig, RouterConfig  # noqa: E402
from cluster.launch.local import LocalCluster  # noqa: E402
from fault_scenarios import (  # noqa: E402  (this folder: sys.path[0] when run as a script)
    BLOCK_SIZE,
    CAPTION,
    Row,
    scenario_flood,
    scenario_kill,
    scenario_kv,
    scenario_redis,
)

logger = logging.getLogger("fault_table")

SCENARIOS = ("redis", "kill", "flood", "kv")


# ------------------------------------------------------------------ clusters
def cluster_config(model: Optional[str], replicas: int, redis_url: Optional[str], **engine: Any) -> ClusterConfig:
    return ClusterConfig(
        replicas=replicas, redis_url=redis_url, namespace=f"faults-{uuid.uuid4().hex[:6]}",
        engine=EngineConfig.from_kwargs(model=model, block_size=BLOCK_SIZE, **engine),
        replica_num_cpus=0.25, routing_policy="cache_aware", router=RouterConfig(drain_timeout_s=2.0))


def run_two_replicas(model: Optional[str], args: Any, budget: Callable[[], float], rows: list[Row]) -> None:
    """The ``redis`` and ``kill`` rows, on one 2-replica cluster (appended to ``rows`` as they end)."""
    from cluster.shared.fingerprint import model_fingerprint
    from cluster.launch.redis_server import RedisServer, find_free_port
    from workers.model.loader import resolve_model

    redis = RedisServer(port=find_free_port()).start()  # a fixed port: a restart keeps the URL
    try:
        config = cluster_config(model, 2, redis.url, num_kv_blocks=512)
        with LocalCluster(config, grpc_port=0) as cluster:
            if "redis" in args.scenarios:
                fingerprint = model_fingerprint(resolve_model(model))
                rows.append(bounded("redis", scenario_redis(cluster.grpc_address, redis, config.namespace,
                                                            fingerprint, args), budget()))
            if "kill" in args.scenarios:
                rows.append(bounded("kill", scenario_kill(cluster.grpc_address, cluster.handle, args), budget()))
    finally:
        redis.stop()


def bounded(scenario: str, coro: Awaitable[Row], timeout: float) -> Row:
    """Runs one scenario's client; one that does not end in time is a failed row
    (a wait inside it that timed out names what it waited for)."""
    try:
        return asyncio.run(asyncio.wait_for(coro, max(1.0, timeout)))
    except (TimeoutError, asyncio.TimeoutError) as exc:
        why = str(exc) or f"still running after {max(1.0, timeout):.0f} s (the time limit)"
        logger.error("%s: %s", scenario, why)
        return Row(scenario, f"{scenario}: did not finish: {why}", "?", 0, -1, "?", None, "timed out", passed=False)
    except Exception as exc:  # noqa: BLE001 - one failed scenario must not cost the others their rows
        logger.exception("%s failed", scenario)
        return Row(scenario, f"{scenario}: failed: {exc!r}", "?", 0, -1, "?", None, "failed", passed=False)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="model folder or .gguf; 'tiny' builds a random-init tiny llama; default: the packaged one")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated subset of {SCENARIOS}")
    parser.add_argument("--json", default="bench-results/faults.json")
    parser.add_argument("--time-limit-s", type=float, default=570.0, help="the whole run stops after this")
    parser.add_argument("--streams", type=int, default=16, help="kill: concurrent streams (>= 16 puts >= 8 on one)")
    parser.add_argument("--kill-tokens", type=int, default=64, help="kill: tokens per stream")
    parser.add_argument("--outage-s", type=float, default=10.0, help="redis: how long redis-server stays down")
    parser.add_argument("--load-concurrency", type=int, default=3, help="redis: clients of background load")
    parser.add_argument("--flood", type=int, default=12, help="flood: requests sent at once")
    parser.add_argument("--flood-tokens", type=int, default=32)
    parser.add_argument("--max-attempts", type=int, default=40, help="flood: tries per client")
    parser.add_argument("--kv-blocks", type=int, default=16, help="kv: device KV blocks (of 16 tokens)")
    parser.add_argument("--kv-streams", type=int, default=5)
    parser.add_argument("--kv-prompt", type=int, default=40)
    parser.add_argument("--kv-tokens", type=int, default=72)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(args.scenarios) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; choose from {SCENARIOS}")
    return args


def markdown(rows: list[Row]) -> str:
    head = ("fault", "in flight at the fault", "requests", "lost", "clear errors", "time to recover", "check", "ok")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        recover = f"{r.recover_s:.2f} s" if r.recover_s is not None else "-"
        lost = str(r.lost) if r.lost >= 0 else "?"
        cells = (r.fault, r.in_flight, str(r.num_requests), lost, r.clear_errors, recover, r.check,
                 "yes" if r.passed else "NO")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"- {r.scenario}: {CAPTION[r.scenario]}" for r in rows]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    began = time.monotonic()
    # The bound: SIGINT unwinds whatever runs (asyncio.run cancels its task), and the finally blocks stop everything.
    watchdog = threading.Timer(args.time_limit_s, lambda: os.kill(os.getpid(), signal.SIGINT))
    watchdog.daemon = True
    watchdog.start()
    model, scratch = args.model, None
    if model == "tiny":
        from tests.factories import make_tiny_model_dir

        scratch = Path(tempfile.mkdtemp(prefix="faults-tiny-"))
        model = str(make_tiny_model_dir("llama", scratch))

    def budget() -> float:
        return args.time_limit_s - (time.monotonic() - began) - 30  # leave time to tear down

    import ray

    from cluster.shared.ray_local import init_local_ray

    rows: list[Row] = []
    init_local_ray()  # one Ray for every cluster (a LocalCluster then leaves it running)
    try:
        if {"redis", "kill"} & set(args.scenarios):
            run_two_replicas(model, args, budget, rows)
        if "flood" in args.scenarios:
            config = cluster_config(model, 1, None, num_kv_blocks=256, max_num_seqs=2, max_waiting_requests=2)
            with LocalCluster(config, grpc_port=0) as cluster:
                rows.append(bounded("flood", scenario_flood(cluster.grpc_address, args), budget()))
        if "kv" in args.scenarios:
            config = cluster_config(model, 1, None, num_kv_blocks=args.kv_blocks)
            with LocalCluster(config, grpc_port=0) as cluster:
                rows.append(bounded("kv", scenario_kv(cluster.grpc_address, cluster.handle, args), budget()))
    except KeyboardInterrupt:
        logger.error("time limit of %.0f s reached: the table holds the rows done so far", args.time_limit_s)
    finally:
        watchdog.cancel()
        ray.shutdown()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    table = markdown(rows)
    print(table)  # the table is the program's output
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"model": args.model or "default", "args": vars(args), "elapsed_s": time.monotonic() - began,
              "rows": [dataclasses.asdict(r) for r in rows], "caption": {r.scenario: CAPTION[r.scenario] for r in rows},
              "table": table}
    path.write_text(json.dumps(report, indent=2, default=str))
    complete = {r.scenario for r in rows} == set(args.scenarios)
    return 0 if complete and all(r.passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
