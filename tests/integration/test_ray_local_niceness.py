"""A local cluster's Ray workers (replicas, tensor-parallel ranks) run at the
driver's niceness, not Ray's default of 15 below it (cluster/shared/ray_local.py
QUIET_RAY): on cores shared with the router and Ray's daemons, a replica's
forward threads would otherwise lose every contention (issue 38)."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.usefixtures("ray_local")


def test_a_ray_worker_runs_at_the_drivers_niceness():
    import ray

    @ray.remote(num_cpus=0)
    def niceness() -> int:
        return os.nice(0)

    assert ray.get(niceness.remote()) == os.nice(0)
