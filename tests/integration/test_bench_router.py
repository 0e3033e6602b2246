"""``prefixserve bench router`` end to end, small: every measured request
succeeds and the JSON holds the figures the table prints."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_router_reports_decision_and_throughput(tmp_path):
    out = tmp_path / "router.json"
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "bench", "router", "--requests", "40", "--decisions", "50",
         "--concurrency", "4", "--tenants", "4", "--prefix-words", "60", "--cached-blocks", "256",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["decision"]["count"] == 50
    assert 0 < report["decision"]["p50_ms"] <= report["decision"]["p99_ms"]
    for part in ("tokenize", "routing_only"):
        assert report["decision"][part]["count"] == 50
        assert 0 < report["decision"][part]["p50_ms"] <= report["decision"]["p99_ms"]
    for run in ("routed", "baseline", "serve_default_router", "routed_before"):
        assert report[run]["requests"] == 40 and report[run]["errors"] == 0
        assert report[run]["requests_per_s"] > 0
        assert report[run]["router_cpu_ms_per_request"] > 0  # the front end's own CPU was read
    assert report["routed_over_baseline_throughput"] > 0
    assert report["router_cpu_before_over_routed"] > 0
    assert "routed / baseline throughput" in proc.stdout
    assert "routed / before" in proc.stdout
