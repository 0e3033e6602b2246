"""Session fixtures of the integration tests: the real services, started once.

Each service has its own section; tests ask for the fixture they need.
"""

from __future__ import annotations

import pytest

# ---------------------------------------------------------------------- Ray


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray on loopback for the whole session (4 logical CPUs, so
    fractional rank actors fit beside other actors on 2 cores)."""
    import ray

    from cluster.shared.ray_local import init_local_ray

    init_local_ray(num_cpus=4)
    yield
    ray.shutdown()


# -------------------------------------------------------------------- Redis
# Owned by the directory work (issue 3): cluster/launch/redis_server.py.


@pytest.fixture(scope="session")
def redis_server():
    """One real ``redis-server`` on a free loopback port for the session.

    Tests share it through distinct namespaces and must not stop it; a test
    that needs Redis to go down starts its own ``RedisServer``.
    """
    from cluster.launch.redis_server import RedisServer

    with RedisServer() as server:
        yield server
