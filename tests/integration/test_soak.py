"""A short soak (``prefixserve soak``): mixed lengths, cancellations,
deadlines and bad requests interleaved on a real local cluster; every
outcome is the expected one and no KV block stays used."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.integration.router_cluster import make_chat_model_dir


def test_short_soak_has_no_unexpected_outcome_and_no_leak(tmp_path):
    model_dir = make_chat_model_dir(tmp_path / "model")  # tiny llama with a ChatML template
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "soak", "--duration", "40", "--concurrency", "6", "--replicas", "2",
         "--max-prompt", "200", "--max-output", "32", "--model", str(model_dir), "--block-size", "4",
         "--num-kv-blocks", "300", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert out.exists(), proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["num_unexpected"] == 0, report["unexpected"]
    assert report["leaked_blocks"] == 0, report["replicas"]
    assert proc.returncode == 0, proc.stderr[-4000:]
    kinds = {key.split(":")[0] for key in report["outcomes"]}
    assert kinds == {"normal", "chat", "cancel", "deadline", "bad"}, report["outcomes"]
    assert report["requests"] >= 30
    assert all(r["num_running_end"] == 0 and r["num_waiting_end"] == 0 for r in report["replicas"].values())
