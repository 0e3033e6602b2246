"""bench routing-lora's pieces: the Zipf workload (a few hot adapters, each with its own system prompt), the
adapters it writes (PEFT's format, bfloat16, shaped for the model: they load), and the per-policy summary."""

from __future__ import annotations

import argparse
import collections

import torch

from cluster.bench.routing_lora import add_routing_lora_args, make_workload, summarize, write_adapters, zipf_weights


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_routing_lora_args(parser)
    return parser.parse_args(list(argv))


def test_the_workload_has_hot_and_cold_adapters_each_with_its_prefix():
    args = _args("--adapters", "12", "--requests", "400", "--prefix-len", "32", "--question-len", "4")
    workload = make_workload(args, vocab_size=5000)
    assert workload == make_workload(args, vocab_size=5000)  # seeded
    assert all(b[0] > a[0] for a, b in zip(workload, workload[1:]))  # arrival order
    counts = collections.Counter(name for _, name, _ in workload)
    assert counts.most_common(1)[0][0] == "adapter-000" and counts["adapter-000"] > 80  # ~32% of 400
    assert len(counts) >= 10  # the cold ones appear too
    prefixes = {}
    for _, name, prompt in workload:
        assert len(prompt) == 36
        assert prefixes.setdefault(name, prompt[:32]) == prompt[:32]
    assert len({tuple(p) for p in prefixes.values()}) == len(prefixes)
    assert abs(sum(zipf_weights(12, 1.1)) - 1) < 1e-9


def test_written_adapters_load_into_the_model(tmp_path):
    from tests.factories import make_hf_config, make_hf_model
    from workers.lora.adapter import load_adapter
    from workers.model.attention.torch_backend import TorchAttentionBackend
    from workers.model.loader import load_model

    make_hf_model(make_hf_config("llama")).save_pretrained(tmp_path / "base")
    write_adapters(tmp_path / "adapters", tmp_path / "base", num=2, rank=4)
    model, _ = load_model(tmp_path / "base", "float32", "cpu", TorchAttentionBackend())
    first = load_adapter("a", str(tmp_path / "adapters" / "adapter-000"), model, max_lora_rank=4)
    second = load_adapter("b", str(tmp_path / "adapters" / "adapter-001"), model, max_lora_rank=4)
    assert first.content_hash != second.content_hash and first.scaling == 2.0
    assert {d.a.dtype for d in first.deltas.values()} == {torch.bfloat16}
    assert len(first.deltas) == 4 * make_hf_config("llama").num_hidden_layers  # qkv, o, gate_up, down


def test_summary_counts_loads_per_minute_and_hits():
    records = [{"ttft": 0.1 * i, "latency": 0.2 * i, "error": "", "prompt": 100, "cached": 50, "replica": f"r{i % 2}"}
               for i in range(1, 11)]
    records.append({"ttft": None, "latency": 1.0, "error": "UNAVAILABLE: no replica"})
    s = summarize(records, duration=120.0, counts={"lora_loads_total": 12.0, "lora_evictions_total": 6.0})
    assert (s["completed"], s["failed"]) == (10, 1)
    assert s["adapter_loads_per_min"] == 6.0 and s["adapter_evictions_per_min"] == 3.0
    assert s["prefix_hit_rate"] == 0.5 and s["requests_per_replica"] == {"r0": 5, "r1": 5}
    assert s["ttft_ms"] == {"p50": 500.0, "p99": 1000.0}  # nearest rank (cluster.client.table)
