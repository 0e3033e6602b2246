"""Starting Ray on this machine with every connection on 127.0.0.1.

On Linux Ray uses the machine's external address for its own traffic (GCS,
raylet, object manager, workers). With ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
it takes the loopback address instead, as it does on a laptop; every process
Ray starts inherits the variable from this one. Ray reads the flag when it is
imported, so a process that imported ``ray`` before calling
``init_local_ray`` gets the flag patched in too.

Shared by the offline ``LLM`` (tensor-parallel ranks), the local launcher
and the integration tests.

``connect_ray`` is the other way: join a Ray cluster that is already running
(``prefixserve up --address``), on one node or several. There the flag must
stay unset: it makes Ray take 127.0.0.1 as this node's address, which a
joining node or driver on another machine cannot reach (and ``ray start``
of a worker refuses to run with it).
"""

from __future__ import annotations

import logging
import math
import os
from typing import Optional

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
ENABLE_CLUSTER_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

# Ray's own background work in a local cluster, which shares the cores with
# the forward (measured idle, default model, one replica, 2 cores: ~100 ms of
# CPU a second before, ~75 after). Serve's controller runs its control loop
# every 0.1 s and each loop reads every node's resources from the GCS
# (ClusterNodeInfoCache.update): 33 ms/s in the controller and most of the
# GCS's 21 ms/s; every 0.5 s it is 17.5 and 13, and deploying or deleting an
# application takes as long (2.1-2.3 s / 3.0 s either way). Ray's metrics
# agent exports metrics nothing here reads (our series are the replicas' and
# routers' own, Serve's autoscaling gets pushed figures): 8.5 ms/s, 2.5 off.
# Ray also starts every worker process (a replica, its tensor-parallel ranks)
# at nice 15 below its raylet, so on cores it shares with the router, Redis
# and Ray's own daemons a replica's forward threads lose every contention and
# a 2-thread step stalls while one thread waits: one replica at c = 16 gave
# 0.93x / 0.88x of the engine's throughput at Ray's default and 0.98x / 0.95x
# at the raylet's niceness (quiet 2-core machine, alternated pairs, issue 38).
# Set any variable to keep Ray's default.
QUIET_RAY = {
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_enable_metrics_collection": "0",
    "RAY_worker_niceness": "0",
}


def init_local_ray(num_cpus: Optional[float] = None, object_store_mb: int = 256) -> None:
    """Starts a local Ray on loopback, unless this process is already connected.

    Args:
        num_cpus: CPUs Ray may schedule (rounded up); defaults to the
            machine's cores. Actors ask for fractions of them.
        object_store_mb: Object store size; Ray's default reserves 30% of RAM.

    Raises:
        ValueError: If ``num_cpus`` or ``object_store_mb`` is not positive.
    """
    if num_cpus is not None and num_cpus <= 0:
        raise ValueError(f"num_cpus must be > 0, got {num_cpus}")
    if object_store_mb <= 0:
        raise ValueError(f"object_store_mb must be > 0, got {object_store_mb}")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no reporting attempts off the machine
    for name, value in QUIET_RAY.items():  # inherited by every process Ray starts; the environment wins
        os.environ.setdefault(name, value)
    import ray
    from ray._private import ray_constants

    if ray.is_initialized():
        return
    # Read at `import ray`: set it here for a process that imported ray earlier.
    ray_constants.ENABLE_RAY_CLUSTER = False
    cpus = math.ceil(num_cpus) if num_cpus is not None else (os.cpu_count() or 2)
    ray.init(
        address="local",
        num_cpus=cpus,
        include_dashboard=False,
        object_store_memory=object_store_mb * 1024**2,
        _node_ip_address=LOOPBACK,
    )
    logger.info("started local Ray on %s with %d CPUs, %d MiB object store", LOOPBACK, cpus, object_store_mb)


def node_ip() -> str:
    """The IP address of the Ray node this process runs on ("" outside Ray)."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else ""


def connect_ray(address: str) -> str:
    """Joins a running Ray cluster as a driver; starts no Ray process.

    Token authentication works as Ray documents it: with ``RAY_AUTH_MODE=token``
    the token comes from ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or
    ``~/.ray/auth_token``.

    Args:
        address: The cluster's GCS ``HOST:PORT``, ``auto`` (the cluster
            ``ray start`` started on this machine) or a ``ray://`` client URL.

    Returns:
        This node's IP address as Ray sees it (what other nodes reach it at).

    Raises:
        ValueError: If ``address`` is empty.
        ConnectionError: Ray found no cluster there (Ray's message kept).
    """
    if not address:
        raise ValueError("the Ray address is empty: give HOST:PORT of the head's GCS, or auto")
    # Set for the single-node path (or by a test harness), it would make this
    # driver advertise 127.0.0.1 to the other nodes.
    os.environ.pop(ENABLE_CLUSTER_VAR, None)
    import ray
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = True
    if not ray.is_initialized():
        ray.init(address=address, logging_level=logging.WARNING)
    node_ip = ray.util.get_node_ip_address()
    logger.info("joined the Ray cluster at %s as node %s (%d nodes alive)", address, node_ip,
                sum(1 for node in ray.nodes() if node.get("Alive")))
    return node_ip
