"""Fetch pricing's default follows how replicas reserve CPUs
(``router/policies/kv_fetch.py``, ``cluster/app/builder.py``): priced where
each replica reserves whole CPUs, off where replicas share cores, and a
configured value always wins."""

from __future__ import annotations

import argparse

import pytest

from cluster.app.builder import routing_params_for
from cluster.bench.routing_transfers import with_fetches
from cluster.shared.config import ClusterConfig
from router.policies import get_policy
from router.policies.kv_fetch import MEASURED_FETCH_BYTES_PER_S, default_fetch_bytes_per_s


@pytest.mark.parametrize("num_cpus, priced", [(0.25, False), (0.5, False), (0.99, False), (1.0, True), (4.0, True)])
def test_fetches_are_priced_by_default_only_where_replicas_own_cores(num_cpus, priced):
    assert default_fetch_bytes_per_s(num_cpus) == (MEASURED_FETCH_BYTES_PER_S if priced else 0.0)
    config = ClusterConfig(replica_num_cpus=num_cpus, routing_policy_params={"fetch_penalty_tokens": 64})
    params = routing_params_for(config)
    assert params == {"fetch_penalty_tokens": 64, "fetch_bytes_per_s": MEASURED_FETCH_BYTES_PER_S if priced else 0.0}
    assert get_policy("prefix_cost", **params).fetch.enabled is priced


def test_a_configured_rate_and_other_policies_are_left_alone():
    config = ClusterConfig(replica_num_cpus=2.0, routing_policy_params={"fetch_bytes_per_s": 0})
    assert routing_params_for(config) == {"fetch_bytes_per_s": 0}  # turned off on purpose: stays off
    config = ClusterConfig(replica_num_cpus=0.25, routing_policy_params={"fetch_bytes_per_s": 2e9})
    assert routing_params_for(config) == {"fetch_bytes_per_s": 2e9}
    config = ClusterConfig(replica_num_cpus=2.0, routing_policy="least_load")
    assert routing_params_for(config) == {}  # a parameter least_load does not know would be an error


def test_bench_routing_off_turns_a_deployments_default_off():
    args = argparse.Namespace(routing_param=["pack_max_seqs=8"], fetch_bytes_per_s=1.5e9)
    assert with_fetches(args, on=False).routing_param == ["pack_max_seqs=8", "fetch_bytes_per_s=0"]
