"""Step time of tensor parallelism vs one process on this machine (default model).

Runs the same hand-built steps through the TP=1 ``ModelRunner`` and the
TP=N ``TensorParallelRunner`` (no scheduler, KV contents irrelevant):
a decode step at batch 1 and batch 32 (context 256) and a 512-token prefill.
For TP=N it splits the driver's wall time into compute and collectives (from
the ranks' own clocks; collective time includes waiting for the slower rank)
and Ray call overhead (driver wall minus the slowest rank), and times a bare
gloo all-reduce of one layer's output for reference. Prints a table, writes
JSON to ``bench-results/tp_steps.json``.

    python scripts/bench_tp.py [--tp 2] [--iters 20]

Run it inside the loopback namespace like the tests (``unshare --net``), or
anywhere Ray may bind 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cluster.shared.config import EngineConfig  # noqa: E402
from cluster.shared.ray_local import init_local_ray  # noqa: E402
from cluster.shared.types import SamplingParams  # noqa: E402
from workers.engine.outputs import ScheduledRequest, SchedulerOutput  # noqa: E402

BLOCK = 16
CONTEXT = 256
PREFILL = 512


def decode_step(batch: int) -> SchedulerOutput:
    """``batch`` decodes at position CONTEXT - 1, each over its own blocks."""
    per_seq = CONTEXT // BLOCK
    reqs = [
        ScheduledRequest(f"d{i}", [100 + i], CONTEXT - 1, list(range(i * per_seq, (i + 1) * per_seq)), 1,
                         SamplingParams(temperature=0.0), [1] * (CONTEXT - 1), [])
        for i in range(batch)
    ]
    return SchedulerOutput(scheduled=reqs)


def prefill_step() -> SchedulerOutput:
    tokens = [(7 * i) % 40000 + 10 for i in range(PREFILL)]
    req = ScheduledRequest("p", tokens, 0, list(range(PREFILL // BLOCK)), 1, SamplingParams(temperature=0.0),
                           tokens, [])
    return SchedulerOutput(scheduled=[req])


def time_steps(runner, sched: SchedulerOutput, iters: int) -> list[float]:
    for _ in range(2):  # warm-up (kernel build, allocator)
        runner.execute(sched)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        runner.execute(sched)
        times.append(time.perf_counter() - start)
    return times


def bench_all_reduce(runner, hidden: int, rows: int, iters: int) -> float:
    """Median seconds of one gloo all-reduce of ``[rows, hidden]`` float32 on the ranks."""
    import ray

    def run(worker, rows, hidden, iters):
        import torch
        import torch.distributed as dist

        x = torch.ones(rows, hidden)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return max(ray.get([r.__ray_call__.remote(run, rows, hidden, iters) for r in runner._ranks]))


def bench_ray_round_trip(runner, iters: int) -> float:
    """Median seconds of one empty call on every rank and ``ray.get`` of all."""
    import ray

    times = []
    for _ in range(iters):
        start = time.perf_counter()
        ray.get([r.__ray_call__.remote(lambda worker: None) for r in runner._ranks])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    from workers.builder import build_local_runner
    from workers.model.loader import read_arch, resolve_model
    from workers.parallel import TensorParallelRunner

    model_dir = resolve_model(None)
    arch = read_arch(model_dir)
    config = EngineConfig.from_kwargs(block_size=BLOCK, num_kv_blocks=32 * CONTEXT // BLOCK, max_model_len=1024,
                                      tensor_parallel_size=args.tp)
    steps = {"decode_b1": decode_step(1), "decode_b32": decode_step(32), "prefill_512": prefill_step()}
    results: dict = {"tp": args.tp, "context": CONTEXT, "steps": {}}

    single = build_local_runner(config, model_dir, 1024)
    for name, sched in steps.items():
        results["steps"][name] = {"tp1_s": statistics.median(time_steps(single, sched, args.iters))}
    del single

    init_local_ray()
    runner = TensorParallelRunner.create(config, model_dir, 1024)
    try:
        for name, sched in steps.items():
            runner.take_timings()
            runner.execute_seconds = 0.0
            wall = statistics.median(time_steps(runner, sched, args.iters))
            ranks = runner.take_timings()
            n = ranks[0]["steps"]
            slowest = max(r["execute_s"] for r in ranks) / n
            row = results["steps"][name]
            row.update(
                tpN_s=wall,
                rank_execute_s=[r["execute_s"] / n for r in ranks],
                rank_comm_s=[r["comm_s"] / n for r in ranks],
                ray_overhead_s=runner.execute_seconds / n - slowest,
            )
        results["gloo_all_reduce_s"] = {
            f"{rows}x{arch.hidden_size}": bench_all_reduce(runner, arch.hidden_size, rows, 200)
            for rows in (1, 32, PREFILL)
        }
        results["ray_round_trip_s"] = bench_ray_round_trip(runner, 200)
    finally:
        runner.shutdown()
    print_table(results, 2 * arch.num_hidden_layers + 2)
    out = ROOT / "bench-results" / "tp_steps.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


def print_table(results: dict, collectives_per_step: int) -> None:
    tp = results["tp"]
    ms = 1e3
    print(f"{'step':<12} {'TP=1 ms':>8} {f'TP={tp} ms':>8} {'ratio':>6}   "
          f"{'per rank: compute / collectives ms':<36} {'Ray ms':>7}")
    for name, row in results["steps"].items():
        per_rank = "  ".join(
            f"r{i} {(e - c) * ms:6.1f} / {c * ms:5.1f}"
            for i, (e, c) in enumerate(zip(row["rank_execute_s"], row["rank_comm_s"]))
        )
        print(f"{name:<12} {row['tp1_s'] * ms:8.1f} {row['tpN_s'] * ms:8.1f} {row['tpN_s'] / row['tp1_s']:6.2f}   "
              f"{per_rank:<36} {row['ray_overhead_s'] * ms:7.2f}")
    print(f"bare gloo all-reduce ({collectives_per_step} collectives per step):")
    for shape, seconds in results["gloo_all_reduce_s"].items():
        print(f"  {shape:<10} {seconds * 1e6:8.0f} us")
    print(f"bare Ray round trip (empty call on every rank): {results['ray_round_trip_s'] * 1e6:.0f} us")


if __name__ == "__main__":
    main()
