"""``prefixserve simulate`` (cluster/bench/simulate.py) on small traces: the
real policies and index over simulated replicas."""

from __future__ import annotations

import argparse
import json

import pytest

from cluster.bench import simulate


def sim_args(tmp_path, **overrides):
    parser = argparse.ArgumentParser()
    simulate.add_simulate_args(parser)
    args = parser.parse_args(["--requests", "600", "--tenants", "50", "--documents", "100", "--blocks-per-replica",
                              "2048", "--json", str(tmp_path / "sim.json"), "--plot", ""])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_oracle_counts_the_longest_prefix_seen_before():
    a = simulate.TraceRequest(0.0, [b"1", b"2", b"3"], 48, 1)
    b = simulate.TraceRequest(1.0, [b"1", b"2", b"9"], 48, 1)
    c = simulate.TraceRequest(2.0, [b"7"], 20, 1)
    assert simulate.oracle_hit_rate([a, b, c], 16) == pytest.approx(32 / 116)


def test_directory_work_per_decision_does_not_grow_with_the_fleet(tmp_path):
    args = sim_args(tmp_path)
    results = {}
    for replicas in (10, 200):
        trace = simulate.synthetic_trace(args, args.rate_per_replica * replicas)
        results[replicas] = simulate.run_one(args, trace, "prefix_cost", replicas, num_routers=4)
    small, large = results[10], results[200]
    # The index is walked along the matched prefix and its holders only:
    # twenty times the replicas, about the same work (the large fleet holds
    # fewer copies of each prefix, so if anything less).
    assert large["index_ops_per_decision"] <= 1.5 * small["index_ops_per_decision"]


def test_cache_aware_routing_beats_round_robin_on_hits_and_ttft(tmp_path):
    args = sim_args(tmp_path)
    trace = simulate.synthetic_trace(args, args.rate_per_replica * 8)
    oracle = simulate.oracle_hit_rate(trace, args.block_size)
    cost = simulate.run_one(args, trace, "prefix_cost", 8, num_routers=2)
    rr = simulate.run_one(args, trace, "round_robin", 8, num_routers=2)
    assert rr["hit_rate"] < cost["hit_rate"] <= oracle + 1e-9
    assert cost["ttft_p50_s"] < rr["ttft_p50_s"]


def test_the_command_writes_its_report(tmp_path, capsys):
    args = sim_args(tmp_path, replicas="4,8", routers="1,3", policies="prefix_cost,round_robin", requests=200)
    assert simulate.run_simulate(args) == 0
    report = json.loads((tmp_path / "sim.json").read_text())
    assert len(report["runs"]) == 2 * 2 * 2 and report["index_bytes_per_entry"] > 0
    assert "hit rate" in capsys.readouterr().out
    assert simulate.run_simulate(sim_args(tmp_path, policies="fastest")) == 2
    with pytest.raises(ValueError, match="hot_prefix_rp"):
        simulate.run_simulate(sim_args(tmp_path, policy_params={"prefix_cost": {"hot_prefix_rp": 0}}))
