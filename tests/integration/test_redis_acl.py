"""The prefix directory behind Redis ACL users (``cluster/shared/directory/acl.py``)
on a real ``redis-server`` started with the ACL file ``prefixserve redis-acl``
prints: replicas write through their user, routers read everything routing
needs through theirs (Lua lookup, index follower, stats, metrics) and cannot
write; a wrong password stops a replica and a router at start-up with an
error that says what to change."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis

from cluster.launch.redis_server import RedisServer
from cluster.shared.directory import Directory, DirectoryAuthError, PublishStatus
from cluster.shared.directory.acl import acl_file
from cluster.shared.directory.follower import IndexFollower
from cluster.shared.hashing import hash_block_chain, root_hash

ADMIN = "admin-only-for-the-test-harness"
PASSWORDS = {"replica": "replica-" + "r" * 16, "router": "router-" + "o" * 16}


@pytest.fixture(scope="module")
def redis_acl(tmp_path_factory):
    path = tmp_path_factory.mktemp("acl") / "users.acl"
    # The file as printed, plus an admin default user for the harness' PING (production: `user default off`).
    text = acl_file(PASSWORDS)
    assert "user default off" in text
    path.write_text(text.replace("user default off", f"user default on >{ADMIN} ~* &* +@all"))
    with RedisServer(password=ADMIN, extra_args=["--aclfile", str(path)]) as server:
        yield server


def url(server: RedisServer, role: str, password: str = "") -> str:
    return f"redis://prefixserve-{role}:{password or PASSWORDS[role]}@127.0.0.1:{server.port}/0"


def test_replicas_write_and_routers_only_read(redis_acl):
    namespace = f"acl-{uuid.uuid4().hex[:6]}"
    chain = hash_block_chain(list(range(32)), 4, root_hash("fp", ""))

    async def main():
        replica = Directory.from_url(url(redis_acl, "replica"), namespace)
        router = Directory.from_url(url(redis_acl, "router"), namespace)
        follower = IndexFollower(Directory.from_url(url(redis_acl, "router"), namespace), poll_s=0.1, block_ms=50)
        try:
            epoch = await replica.register("r1", "contract-1")
            assert await replica.resync("r1", epoch, 1, chain[:5]) is PublishStatus.OK
            assert await replica.heartbeat("r1", epoch, {"num_running": 2}) is PublishStatus.OK
            assert await replica.publish_metrics("r1", epoch, "x_total 1\n") is PublishStatus.OK
            await replica.gc()
            # Everything a router does, through the router's user.
            assert await router.check_read_access()
            assert await router.lookup(chain, "contract-1") == {"r1": 5}
            assert (await router.replica_stats())["r1"]["num_running"] == 2
            assert b"x_total" in (await router.replica_metrics())["r1"]
            follower.start()
            assert await follower.wait_in_sync(30)
            assert follower.lookup(chain, "contract-1") == {"r1": 5}
            # ...and nothing a replica does.
            for write in (lambda: router.register("r2"), lambda: router.heartbeat("r1", epoch),
                          lambda: router.resync("r1", epoch, 2, chain)):
                with pytest.raises(DirectoryAuthError, match="may not do it .*'router' ACL"):
                    await write()
            assert await router.lookup(chain, "contract-1") == {"r1": 5}  # unchanged
        finally:
            await follower.stop()
            for d in (replica, router):
                await d.aclose()

    asyncio.run(main())


def test_a_wrong_password_is_a_clear_error_not_an_outage(redis_acl):
    namespace = f"acl-{uuid.uuid4().hex[:6]}"

    async def main():
        for role in ("router", "replica"):
            directory = Directory.from_url(url(redis_acl, role, password="wrong-password-123456"), namespace)
            try:
                with pytest.raises(DirectoryAuthError, match="refused the credentials.*redis://USER:PASSWORD@"):
                    await directory.check_read_access()
            finally:
                await directory.aclose()

    asyncio.run(main())


def test_a_replica_with_the_wrong_password_refuses_to_start(redis_acl, tmp_path):
    from tests.factories import make_tiny_model_dir
    from workers.replica import ReplicaServer

    model_dir = make_tiny_model_dir("llama", tmp_path)
    with pytest.raises(RuntimeError, match="refused the credentials"):
        ReplicaServer({"model": str(model_dir), "block_size": 4},
                      redis_url=url(redis_acl, "replica", password="not-the-password-123"),
                      namespace=f"acl-{uuid.uuid4().hex[:6]}", replica_id="r-bad")
    # The right one starts and registers.
    server = ReplicaServer({"model": str(model_dir), "block_size": 4}, redis_url=url(redis_acl, "replica"),
                           namespace="acl-ok", replica_id="r-ok")
    try:
        async def live():
            d = Directory.from_url(url(redis_acl, "router"), "acl-ok")
            try:
                return await d.live_replicas()
            finally:
                await d.aclose()

        assert "r-ok" in asyncio.run(live())
    finally:
        server.shutdown()


def test_a_router_with_the_wrong_password_refuses_to_start(redis_acl, tmp_path):
    from router.deployment import FrontEndOptions, RouterDeployment
    from cluster.shared.config import RouterConfig
    from tests.factories import make_tiny_model_dir

    model_dir = make_tiny_model_dir("llama", tmp_path)
    options = FrontEndOptions(model_dir=str(model_dir), model_name="tiny", max_model_len=256,
                              redis_url=url(redis_acl, "router", password="not-the-password-123"),
                              namespace="acl-router", router=RouterConfig(grpc_port=0, http_port=None))

    async def start():
        router = RouterDeployment.__new__(RouterDeployment)
        await router.__init__(None, options)

    with pytest.raises(DirectoryAuthError, match="refused the credentials"):
        asyncio.run(start())


def test_routers_may_hold_the_metrics_exporter_lease_and_nothing_more(redis_acl):
    namespace = f"acl-{uuid.uuid4().hex[:6]}"

    async def main():
        router = Directory.from_url(url(redis_acl, "router"), namespace)
        other = Directory.from_url(url(redis_acl, "router"), namespace)
        try:
            assert await router.claim_metrics_exporter("router-a", 30)
            assert not await other.claim_metrics_exporter("router-b", 30)
            assert await router.release_metrics_exporter("router-a")
            assert await other.claim_metrics_exporter("router-b", 30)
            with pytest.raises(redis.exceptions.NoPermissionError):  # SET elsewhere is still refused
                await router._client.set(f"ps:{{{namespace}}}:rep:x", b"1")
        finally:
            await router.aclose()
            await other.aclose()

    asyncio.run(main())


def test_routers_store_responses_and_write_nothing_else_there(redis_acl):
    from router.openai.response_store import RedisResponseStore

    async def main():
        store = RedisResponseStore.from_url(url(redis_acl, "router"), "acl-responses", ttl_s=60)
        try:
            await store.put("tenant", "resp_1", {"response": {"id": "resp_1"}})
            await store.set_flag("tenant", "resp_1", "lease", 10)
            assert await store.get("tenant", "resp_1") == {"response": {"id": "resp_1"}}
            assert await store.has_flag("tenant", "resp_1", "lease")
            assert await store.delete("tenant", "resp_1")
            with pytest.raises(redis.exceptions.NoPermissionError):  # other commands on those keys: refused
                await store._client.append("ps:responses:acl-responses:tenant:resp_2", "x")
        finally:
            await store.aclose()

    asyncio.run(main())


def test_routers_share_run_time_lora_adapters_and_write_nothing_else_there(redis_acl):
    from router.lora_registry import RuntimeAdapters

    async def main():
        first = RuntimeAdapters.from_url(url(redis_acl, "router"), "acl-lora")
        second = RuntimeAdapters.from_url(url(redis_acl, "router"), "acl-lora")
        try:
            await first.add("sql", "/adapters/sql", 7)
            await second.maybe_refresh()  # another router sees it
            assert second.get("sql") == ("/adapters/sql", 7)
            assert await second.remove("sql") and not await first.remove("sql")
            with pytest.raises(redis.exceptions.NoPermissionError):  # other commands on those keys: refused
                await first._client.set("ps:lora:acl-lora", "x")
        finally:
            await first.aclose()
            await second.aclose()

    asyncio.run(main())
