"""``prefixserve simulate`` (cluster/bench/simulate.py) on small traces: the
real policies and index over simulated replicas."""

from __future__ import annotations

import argparse
import json

import pytest

from cluster.bench import simulate
from cluster.bench import simulate_transfer as transfer


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


def test_a_fetch_copies_the_holders_blocks_and_publishes_them(tmp_path):
    args = sim_args(tmp_path, transfers="off,on", fetch_bytes_per_s=1e9, fetch_overhead_s=0.01,
                    holder_read_bytes_per_s=2e9, kv_bytes_per_token=1000.0, blocks_per_replica=64)
    fleet = simulate.Fleet(args, 2)
    holder, receiver = fleet.ids
    chain = [bytes([i]) * 16 for i in range(10)]
    fleet.store(holder, chain[:8])
    fleet.store(receiver, chain[:2])
    fetches = transfer.Transfers(args)
    # 6 blocks of 16 tokens of 1000 bytes: 96 kB at 1 GB/s, 10 ms, the holder's read at 2 GB/s.
    ready = fetches.fetch(fleet, receiver, holder, chain, now=5.0)
    assert ready == pytest.approx(5.0 + 96e3 / 1e9 + 0.01 + 96e3 / 2e9)
    assert list(fleet.replicas[receiver].cache) == chain[:8]
    assert fleet.index.lookup(chain) == {holder: 8, receiver: 8}
    assert fleet.replicas[holder].busy_until == pytest.approx(5.0 + 96e3 / 2e9)  # the read took its CPU
    assert fetches.fetch(fleet, receiver, holder, chain, now=5.0) == 5.0  # nothing more to move
    assert fetches.results(4)["fetch_fallbacks"] == {"not_held": 1}
    # Two fetches in flight (each ~10 ms): a third is refused, as the replica's limit does.
    second, third = ([tag * 16] + [bytes([100 + i]) * 16 for i in range(3)] for tag in (b"y", b"z"))
    fleet.store(holder, second + third)
    assert fetches.fetch(fleet, receiver, holder, second, now=5.001) > 5.001
    assert fetches.fetch(fleet, receiver, holder, third, now=5.002) == 5.002
    assert fetches.results(4)["fetch_fallbacks"] == {"busy": 1, "not_held": 1}
    assert fetches.fetch(fleet, receiver, holder, third, now=6.0) > 6.0  # both done by then
    assert fetches.results(4)["fetches_per_100"] == 3 / 4 * 100
    assert transfer.transfer_modes(args) == [False, True]
    with pytest.raises(ValueError, match="--transfers"):
        transfer.transfer_modes(sim_args(tmp_path, transfers="sometimes"))


def test_transfers_raise_the_hit_rate_and_cut_the_tail_on_a_skewed_workload(tmp_path):
    # A few Zipf-hot system prompts, small caches and a load that queues on
    # their holders: without transfers a spilled request recomputes the prompt
    # (or waits behind the holder); with them it copies the prefix.
    args = sim_args(tmp_path, requests=1200, tenants=40, zipf=1.3, rag_fraction=0.0, turns=1, rate_per_replica=1.0,
                    blocks_per_replica=512)
    trace = simulate.synthetic_trace(args, args.rate_per_replica * 8)
    off = simulate.run_one(args, trace, "prefix_cost", 8, num_routers=2)
    on = simulate.run_one(args, trace, "prefix_cost", 8, num_routers=2, transfers=True)
    assert off["transfers"] == "off" and "fetches_per_100" not in off
    assert on["fetches_per_100"] > 0 and on["fetched_gb"] > 0
    assert on["hit_rate"] > off["hit_rate"]
    assert on["ttft_p99_s"] < off["ttft_p99_s"]
