"""Where tensor-parallel ranks run and how many threads each computes with.

Inside a placement group (a Serve replica deployed with
``placement_group_bundles``) the ranks go into its *last* N bundles, each
asking for its bundle's CPU and GPU; bundle 0 stays the replica's own
(``cluster/app/builder.py`` asks for 1 + N bundles, STRICT_PACK). Outside one
they are created with ``num_cpus_per_rank`` CPUs. Each rank (and a replica
without TP) runs ``torch.set_num_threads`` with its share of the cores: its
whole CPUs, or the machine's cores split over the processes when it asks for
a fraction.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class RankPlacement:
    """Ray resources and bundle of one rank actor."""

    num_cpus: float
    num_gpus: float
    bundle_index: Optional[int] = None  # None: outside any placement group


def rank_placements(
    world_size: int, num_cpus_per_rank: float, num_gpus_per_rank: float, placement_group: Any = None
) -> list[RankPlacement]:
    """Where the ranks go: the last ``world_size`` bundles of ``placement_group``
    (their resources), else anywhere with the given resources.

    Raises:
        ValueError: If the placement group has no room for the ranks.
    """
    if placement_group is None:
        return [RankPlacement(num_cpus_per_rank, num_gpus_per_rank) for _ in range(world_size)]
    bundles = placement_group.bundle_specs
    if len(bundles) <= world_size:
        raise ValueError(
            f"the current placement group has {len(bundles)} bundles; tensor_parallel_size {world_size} needs "
            f"{world_size + 1}: bundle 0 for the replica, then one per rank (set placement_group_bundles)"
        )
    first = len(bundles) - world_size
    return [
        RankPlacement(float(b.get("CPU", 0.0)), float(b.get("GPU", 0.0)), first + i)
        for i, b in enumerate(bundles[first:])
    ]


def machine_cores() -> int:
    """The cores this process may run on (its affinity, and a container's CPU
    quota as Ray reads it)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        from ray._private.utils import get_num_cpus

        cores = min(cores, max(1, int(get_num_cpus())))
    except Exception:  # noqa: BLE001 - older Ray, or no cgroup to read
        pass
    return max(1, cores)


def threads_per_rank(num_cpus: float, world_size: int, cores: Optional[int] = None) -> int:
    """Torch threads of a rank (or of a replica, ``world_size`` being the
    processes that share the machine): its whole CPUs, or its share of the
    machine's cores when it asks for a fraction of a CPU."""
    if num_cpus >= 1:
        return int(num_cpus)
    return max(1, (cores or machine_cores()) // max(1, world_size))


def set_cpu_threads(num_threads: int) -> None:
    """Torch's (and OpenMP's) threads of this process, for the forward."""
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    torch.set_num_threads(num_threads)
