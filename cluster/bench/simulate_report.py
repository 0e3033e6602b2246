"""The output of ``prefixserve simulate`` (``cluster/bench/simulate.py``): the
table on stdout, the JSON report and the PNG (hit rate over the oracle and
decision time against the fleet size)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from cluster.client.table import format_table

logger = logging.getLogger(__name__)


def print_table(report: dict[str, Any]) -> None:
    transfers = any(r.get("transfers") == "on" for r in report["runs"])
    rows = [("policy", "replicas", "routers") + (("transfers",) if transfers else ())
            + ("hit rate", "/oracle", "TTFT p50 s", "p99", "decision p50 us", "p99",
               "decisions/s", "index ops/dec", "p99 ops", "index entries", "batches/s/replica")
            + (("loads/min", "evictions/min") if report["args"].get("adapters") else ())
            + (("fetches/100 req", "GB moved", "fallbacks") if transfers else ())]
    for r in report["runs"]:
        rows.append((r["policy"], str(r["replicas"]), str(r["routers"]))
                    + ((r.get("transfers", "off"),) if transfers else ())
                    + (f"{r['hit_rate']:.1%}",
                       f"{r['hit_rate_over_oracle']:.3f}", f"{r['ttft_p50_s']:.2f}", f"{r['ttft_p99_s']:.2f}",
                       f"{r['decision_p50_us']:.0f}", f"{r['decision_p99_us']:.0f}", str(r["decisions_per_s"]),
                       f"{r['index_ops_per_decision']:.1f}", f"{r['index_ops_p99']:.0f}", str(r["index_entries"]),
                       f"{r['event_batches_per_s_per_replica']:.2f}")
                    + ((f"{r['adapter_loads_per_min']:.0f}", f"{r['adapter_evictions_per_min']:.0f}")
                       if "adapter_loads_per_min" in r else ())
                    + ((f"{r['fetches_per_100']:.1f}", f"{r['fetched_gb']:.2f}",
                        str(sum(r["fetch_fallbacks"].values())))
                       if "fetches_per_100" in r else (("-", "-", "-") if transfers else ())))
    lines = format_table(rows)
    lines.append(f"index memory: {report['index_bytes_per_entry']:.0f} bytes per (block, replica) entry "
                 f"(Python, measured)")
    sys.stdout.write("\n".join(lines) + "\n")  # the table is the program's output, not a log


def write(report: dict[str, Any], args: argparse.Namespace) -> None:
    from pathlib import Path

    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        logger.info("wrote %s", args.json)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for policy in sorted({r["policy"] for r in report["runs"]}):
            for routers, mode in sorted({(r["routers"], r.get("transfers", "off")) for r in report["runs"]}):
                rows = sorted((r for r in report["runs"] if r["policy"] == policy and r["routers"] == routers
                               and r.get("transfers", "off") == mode), key=lambda r: r["replicas"])
                if not rows:
                    continue
                xs, label = [r["replicas"] for r in rows], f"{policy}, {routers} routers" + (
                    ", transfers" if mode == "on" else "")
                ax1.plot(xs, [r["hit_rate_over_oracle"] for r in rows], marker="o", label=label)
                ax2.plot(xs, [r["decision_p99_us"] for r in rows], marker="o", label=label)
        ax1.set(xscale="log", xlabel="replicas", ylabel="hit rate / oracle", title="prefix-cache hit rate")
        ax2.set(xscale="log", xlabel="replicas", ylabel="µs", title="decision CPU time, P99")
        ax1.legend(fontsize=7)
        fig.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
        logger.info("wrote %s", args.plot)
