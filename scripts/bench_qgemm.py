"""The exact quantized GEMM (``workers/model/qgemm.py``) against the float32 GEMM and the read
roofline, on the default model's shapes, every kernel interleaved round by round in one process.

    prefill   M rows (512) of each projection shape: the float32 GEMM (``gemm.py``) and the
              quantized kernel on 4-bit weights with groups of 32 (GGUF Q4_1 / int4's default)
              and 128; the ratio is float32's time over the kernel's (above 1: faster)
    batch 1   one row through the model's 30 layers in order (the weights then stream from
              memory, as in a decode step) and the LM head's 49152 x 576 8-bit weight (the
              int4 / int8 modes' head); each shape and the whole step against the read
              roofline: its bytes over a read bandwidth measured in the same rounds
              (``cluster/bench/roofline.py``)

``--cpu-time`` times with the calling thread's CPU clock, the bandwidth too, on one thread: on a
shared machine the other processes' time slices then drop out of every figure (their cache
traffic does not). ``--avx2`` builds both kernels for AVX2 + FMA (the CPUs without AVX-512).
Prints a table and writes JSON.

    .venv/bin/python scripts/bench_qgemm.py [--threads 2] [--cpu-time] [--avx2] [--rounds 7]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cluster.bench.roofline import measure_read_gbps  # noqa: E402
from workers.model import gemm, native, qgemm  # noqa: E402

SHAPES = [("qkv_proj", 960, 576), ("o_proj", 576, 576), ("gate_up_proj", 3072, 576), ("down_proj", 576, 1536)]
LM_HEAD = ("lm_head (8-bit)", 49152, 576)
AVX2_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-mno-avx512f", "-fopenmp", "-shared", "-fPIC")


def libraries(avx2: bool) -> tuple[Any, Any]:
    if not avx2:
        return gemm.load(), qgemm.load()
    glib = native.build("gemm_f32_avx2", gemm._SOURCE, AVX2_FLAGS, gemm._SIGNATURES)
    qlib = native.build("qgemm_f32_avx2", qgemm._SOURCE, AVX2_FLAGS, qgemm._SIGNATURES)
    if glib is None or qlib is None:
        raise SystemExit("the AVX2 builds failed (no compiler?)")
    glib.gemm_panel_width.restype = glib.gemm_rows_per_block.restype = ctypes.c_int
    qlib.qgemm_panel_width.restype = ctypes.c_int
    return glib, qlib


def quant_weight(rng: np.random.Generator, n: int, k: int, bits: int, group: int, qlib: Any) -> qgemm.QuantWeight:
    groups = -(-k // group)
    q = rng.integers(0, 16, (n, k)).astype(np.uint8) if bits == 4 else rng.integers(-127, 128, (n, k)).astype(np.int8)
    scales = (rng.random((n, groups)) * 0.01 + 1e-4).astype(np.float32)
    mins = (rng.standard_normal((n, groups)) * 0.05).astype(np.float32) if bits == 4 else None
    return qgemm.QuantWeight(q, scales, mins, bits, group, None, qlib)


def timed_rounds(kernels: dict[str, Callable[[], Any]], rounds: int, reps: int,
                 clock: Callable[[], float]) -> dict[str, float]:
    """Median ms of each kernel over ``rounds``, the kernels alternating within each round, in reverse
    order every other round (whichever runs first after another's data measured up to 10% slower here)."""
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for i in range(rounds):
        for name, run in list(kernels.items())[:: 1 if i % 2 == 0 else -1]:
            run()  # warm: the shape's weight and x into cache, as a prefill's next layer finds them
            begin = clock()
            for _ in range(reps):
                run()
            times[name].append((clock() - begin) / reps * 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


def prefill(args: argparse.Namespace, glib: Any, qlib: Any, clock: Callable[[], float]) -> list[dict[str, Any]]:
    rng, rows = np.random.default_rng(0), []
    for name, n, k in SHAPES:
        x = torch.randn(args.m, k)
        f32 = gemm.PackedWeight(torch.randn(n, k) * 0.02, None, glib)
        kernels = {"f32": lambda f=f32: f.matmul(x)}
        for group in (32, 128):
            w = quant_weight(rng, n, k, 4, group, qlib)
            kernels[f"g{group}"] = lambda w=w: w.matmul(x)
        med = timed_rounds(kernels, args.rounds, args.reps, clock)
        rows.append({"shape": f"{name} {n}x{k}", "m": args.m, "f32_ms": med["f32"],
                     **{f"{g}_ms": med[g] for g in ("g32", "g128")},
                     **{f"{g}_speed": med["f32"] / med[g] for g in ("g32", "g128")}})
    return rows


def batch_one(args: argparse.Namespace, qlib: Any, clock: Callable[[], float],
              gbps: Callable[[], float]) -> list[dict[str, Any]]:
    """One row through every layer in the model's order (its weights then stream from memory, as in a
    decode step), each shape's time summed over its layers, then the LM head; the whole step last."""
    rng = np.random.default_rng(1)
    layers = [[quant_weight(rng, n, k, 4, 32, qlib) for _, n, k in SHAPES] for _ in range(args.layers)]
    head = quant_weight(rng, LM_HEAD[1], LM_HEAD[2], 8, 32, qlib)
    names = [s[0] for s in SHAPES] + [LM_HEAD[0]]
    nbytes = [sum(layer[i].nbytes for layer in layers) for i in range(len(SHAPES))] + [head.nbytes]
    xs = [torch.randn(1, k) for _, _, k in SHAPES] + [torch.randn(1, LM_HEAD[2])]
    times: list[list[float]] = [[] for _ in names]
    rates: list[float] = []
    for _ in range(args.rounds):
        rates.append(gbps())
        spent = [0.0] * len(names)
        for layer in layers:
            for i, w in enumerate(layer):
                begin = clock()
                w.matmul(xs[i])
                spent[i] += clock() - begin
        begin = clock()
        head.matmul(xs[-1])
        spent[-1] = clock() - begin
        for i, t in enumerate(spent):
            times[i].append(t * 1e3)
    rate = statistics.median(rates)
    rows = []
    for i, name in enumerate(names + ["step"]):
        ms = statistics.median(times[i]) if i < len(names) else statistics.median(map(sum, zip(*times)))
        size = nbytes[i] if i < len(names) else sum(nbytes)
        count = 1 if i >= len(SHAPES) else args.layers
        floor_ms = size / (rate * 1e9) * 1e3
        rows.append({"shape": name if count == 1 else f"{name} x{count}", "bytes": size, "ms": ms, "gbps": rate,
                     "floor_ms": floor_ms, "roofline": floor_ms / ms})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpu-time", action="store_true", help="one thread, timed by its CPU clock")
    parser.add_argument("--avx2", action="store_true", help="AVX2 + FMA builds of both kernels")
    parser.add_argument("--m", type=int, default=512, help="prefill rows")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=2, help="prefill calls timed per round")
    parser.add_argument("--layers", type=int, default=30, help="layers of each shape in a batch-1 step")
    parser.add_argument("--json", default="bench-results/qgemm.json")
    args = parser.parse_args()
    torch.set_num_threads(1 if args.cpu_time else args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    gbps = lambda: measure_read_gbps(256, 2, clock)  # noqa: E731
    glib, qlib = libraries(args.avx2)
    report = {"threads": 1 if args.cpu_time else args.threads, "cpu_time": args.cpu_time, "avx2": args.avx2,
              "panel_width": qlib.qgemm_panel_width(), "prefill": prefill(args, glib, qlib, clock),
              "batch1": batch_one(args, qlib, clock, gbps)}
    print(f"threads {report['threads']}, {'AVX2' if args.avx2 else 'native'} build (panel {report['panel_width']}),"
          f" {'thread CPU time' if args.cpu_time else 'wall clock'}, medians of {args.rounds} interleaved rounds")
    print(f"{'prefill':<26} {'f32 ms':>8} {'g32 ms':>8} {'speed':>6} {'g128 ms':>8} {'speed':>6}")
    for r in report["prefill"]:
        print(f"{r['shape']:<26} {r['f32_ms']:8.2f} {r['g32_ms']:8.2f} {r['g32_speed']:5.2f}x "
              f"{r['g128_ms']:8.2f} {r['g128_speed']:5.2f}x")
    print(f"{'batch 1 (groups of 32)':<34} {'MB':>6} {'ms':>7} {'GB/s':>6} {'floor':>7} {'roofline':>8}")
    for r in report["batch1"]:
        print(f"{r['shape']:<34} {r['bytes'] / 1e6:6.1f} {r['ms']:7.3f} {r['gbps']:6.1f} {r['floor_ms']:7.3f} "
              f"{r['roofline']:8.0%}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
