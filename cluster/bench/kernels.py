"""``prefixserve bench kernels``: every linear-layer backend on the model's own
shapes, at the step sizes that matter, and whether each is batch-invariant.

For each projection shape of the model (fused q/k/v, o, fused gate/up, down,
LM head) and each ``M`` (tokens in the step), each backend of
``workers/model/linear.py`` runs ``x [M, K] @ W.T`` on weights packed its
way; the table gives milliseconds for all layers of that shape (the LM head
once), the backend ``auto`` picks and the fastest, and whether a row's result
is bitwise the same alone (M = 1) as inside the M-row batch.

Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from cluster.client.table import format_table

logger = logging.getLogger(__name__)


def add_kernels_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--m", type=int, nargs="+", default=[1, 8, 32, 128, 512], help="tokens in the step")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", default="bench-results/kernels.json")


def model_shapes(model: Any) -> list[tuple[str, int, int, int]]:
    """``(name, out_features, in_features, count)`` of the model's linear layers."""
    from workers.model.loader import read_arch, resolve_model

    arch = read_arch(resolve_model(model))
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    layers = arch.num_hidden_layers
    return [
        ("qkv_proj", q + 2 * kv, arch.hidden_size, layers),
        ("o_proj", arch.hidden_size, q, layers),
        ("gate_up_proj", 2 * arch.intermediate_size, arch.hidden_size, layers),
        ("down_proj", arch.hidden_size, arch.intermediate_size, layers),
        ("lm_head", arch.vocab_size, arch.hidden_size, 1),
    ]


def _kernel(weight: Any, backend: str) -> Callable:
    import torch
    import torch.nn.functional as F

    from workers.model import gemm

    if backend == "torch":
        return lambda x: F.linear(x, weight)
    if backend == "onednn":
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return gemm.PackedWeight(weight, None, gemm.load()).matmul


def run_kernels(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    import torch

    from workers.model.linear import resolve_linear_backend

    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = torch.device("cpu")
    backends = [b for b in ("native", "onednn", "torch") if _available(b, cpu)]
    auto = resolve_linear_backend("auto", cpu, torch.float32)
    results: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(0)
    for name, n, k, count in model_shapes(engine_args.get("model")):
        # One weight per layer, as in the model: they stream from memory, not from a cache.
        weights = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(count)]
        for backend in backends:
            kernels = [_kernel(w, backend) for w in weights]
            for m in args.m:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                row = next((r for r in results if r["shape"] == name and r["m"] == m), None)
                if row is None:
                    row = {"shape": name, "n": n, "k": k, "layers": count, "m": m, "ms": {}, "invariant": {}}
                    results.append(row)
                for fn in kernels[:2]:
                    fn(x)  # warm
                times = []
                for _ in range(args.reps):
                    begin = time.perf_counter()
                    for fn in kernels:
                        fn(x)
                    times.append(time.perf_counter() - begin)
                row["ms"][backend] = round(statistics.median(times) * 1e3, 3)
                row["invariant"][backend] = bool(torch.equal(kernels[0](x[:1]), kernels[0](x)[:1]))
                logger.info("%s M=%d %s: %.2f ms", name, m, backend, row["ms"][backend])
            del kernels
    for row in results:
        row["fastest"] = min(row["ms"], key=row["ms"].get)
    report = {"threads": torch.get_num_threads(), "auto": auto, "backends": backends, "results": results}
    print("\n".join(format_kernels(report)))  # the table is the program's output
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    return 0


def _available(backend: str, device: Any) -> bool:
    import torch

    from workers.model.linear import resolve_linear_backend

    try:
        resolve_linear_backend(backend, device, torch.float32)
        return True
    except ValueError:
        return False


def format_kernels(report: dict[str, Any]) -> list[str]:
    backends = report["backends"]
    rows = [("shape", "N x K", "layers", "M") + tuple(f"{b} ms" for b in backends) + ("fastest", "row alone = in batch")]
    totals: dict[tuple[int, str], float] = {}
    for r in report["results"]:
        rows.append((r["shape"], f"{r['n']}x{r['k']}", str(r["layers"]), str(r["m"]))
                    + tuple(f"{r['ms'][b]:.2f}" for b in backends)
                    + (r["fastest"], " ".join(f"{b}:{'yes' if r['invariant'][b] else 'NO'}" for b in backends)))
        for b in backends:
            totals[(r["m"], b)] = totals.get((r["m"], b), 0.0) + r["ms"][b]
    for m in sorted({m for m, _ in totals}):
        rows.append(("all layers + head", "", "", str(m)) + tuple(f"{totals[(m, b)]:.2f}" for b in backends)
                    + (min(backends, key=lambda b: totals[(m, b)]), ""))
    lines = format_table(rows)
    lines.append(f"{report['threads']} threads; linear_backend auto picks {report['auto']!r} here")
    return lines
