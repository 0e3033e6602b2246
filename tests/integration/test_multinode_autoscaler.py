"""Autoscaling across nodes (issue 50 item 5): Ray's autoscaler on its fake
multi-node provider (``provider.type: fake_multinode``, the one Ray documents
for testing autoscaling on one machine; ``multinode.py`` starts it on the
head with ``--autoscaling-config``). The head offers 1 CPU and holds one
replica and no more: each replica reserves 1 CPU, or (second case) 0.25 CPU
with ``--max-replicas-per-node 1``.

``prefixserve up --address`` with the KV-aware replica autoscaling policy
(min 1, max 2): load that fills the replica's KV cache makes the policy ask
Serve for a second replica, which cannot fit; Ray's autoscaler sees the
pending demand and adds a node (its raylet, object store and workers started
by the autoscaler's provider, under the autoscaler's process); the replica
starts there and answers requests. Idle, the policy removes a replica after
a drain, then the autoscaler removes the idle node.

The fake provider's nodes share the head's node IP (127.0.0.1): each is a
Ray node of its own (node ID, raylet, object store), so where a replica runs
is read from the process tree, not from its address.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter

import grpc
import psutil
import pytest

from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc
from tests.factories import make_tiny_model_dir
from tests.integration.multinode import RayNodes
from tests.integration.up_process import start_up, stop_up, wait_for_log

MAX_TOKENS = 24
PROMPT_LEN = 20  # 5 full blocks of 4; with the output a request holds 11 of the 48 blocks
WAIT_S = 240.0

AUTOSCALER = {  # Ray's fake multi-node provider; one node type of 1 CPU, at most 2 such nodes
    "cluster_name": "prefixserve-fake", "max_workers": 2, "upscaling_speed": 1.0, "idle_timeout_minutes": 0.1,
    "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                 "disable_launch_config_check": True},
    "head_node_type": "ray.head.default",
    "available_node_types": {
        "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
        "ray.worker.cpu": {"resources": {"CPU": 1, "object_store_memory": 128 * 1024**2}, "node_config": {},
                           "min_workers": 0, "max_workers": 2}},
    # Keys the autoscaler reads whatever the provider (the fake one runs no commands, syncs no files).
    "docker": {}, "auth": {}, "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
    "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
    "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
    "worker_start_ray_commands": []}

SCALING_YAML = """\
autoscaling:
  min_replicas: 1
  max_replicas: 2
  target_kv_cache_usage: 0.3
  target_num_waiting: 1000000
  target_ttft_s: null
  upscale_delay_s: 1.0
  downscale_delay_s: 3.0
  look_back_period_s: 2.0
  metrics_interval_s: 0.5
"""


def replicas_on_added_nodes(nodes: RayNodes) -> int:
    """Serve replica processes under the autoscaler (on nodes it added)."""
    count = 0
    for proc in nodes.nodes[0].processes():
        try:
            if "monitor.py" in " ".join(proc.cmdline()):
                count += sum("ServeReplica" in " ".join(c.cmdline()) for c in proc.children(recursive=True))
        except psutil.Error:
            pass
    return count


@pytest.fixture(scope="module")
def nodes():
    with RayNodes(num_workers=0, num_cpus=1, autoscaling_config=AUTOSCALER) as started:
        yield started


# What keeps a second replica off the head: its CPUs (the default: replicas
# spread where there is room), or --max-replicas-per-node 1 (Serve's implicit
# per-node resource, which Ray's autoscaler knows every node type has).
FULL_HEAD = {"cpus": ("--replica-num-cpus", "1"),
             "per-node cap": ("--replica-num-cpus", "0.25", "--max-replicas-per-node", "1")}


@pytest.fixture(params=list(FULL_HEAD))
def cluster(request, nodes, tmp_path_factory):
    model_dir = make_tiny_model_dir("llama", tmp_path_factory.mktemp("as-model") / "tiny")
    config = tmp_path_factory.mktemp("as-config") / "cluster.yaml"
    config.write_text(SCALING_YAML)
    proc, log = start_up(tmp_path_factory.mktemp("as-up") / "up.log", "--config", str(config),
                         "--address", nodes.address, "--replicas", "1", "--routing-policy", "least_load",
                         "--model", str(model_dir), "--block-size", "4", "--num-kv-blocks", "48",
                         "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--swap-space", "0.01",
                         *FULL_HEAD[request.param], "--grpc-port", "0", "--http-port", "-1",
                         env=nodes.client_env())
    try:
        text = wait_for_log(proc, log, "ready: gRPC on")
        yield nodes, re.search(r"gRPC on (127\.0\.0\.1:\d+)", text).group(1), request.param
    finally:
        stop_up(proc, log)


def request(tag: str) -> pb.GenerateRequest:
    first = 3 + sum(map(ord, tag)) % 500  # no two requests share a block: KV use grows with the load
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[first] + list(range(3, 3 + PROMPT_LEN - 1))),
                              sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))


async def live_replicas(stub) -> set[str]:
    reply = await stub.ListReplicas(pb.ListReplicasRequest(), timeout=30)
    return {r.replica_id for r in reply.replicas}


def test_load_adds_a_node_whose_replica_takes_traffic_and_idle_removes_both(cluster):
    nodes, address, variant = cluster

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            first = await live_replicas(stub)
            before = (len(nodes.alive_node_ips()), replicas_on_added_nodes(nodes))
            served: Counter = Counter()
            stop = asyncio.Event()

            async def client(i: int) -> None:
                sent = 0
                while not stop.is_set():
                    tokens, replica = [], ""
                    async for chunk in stub.Generate(request(f"{i}-{sent}"), timeout=120):
                        tokens.extend(chunk.token_ids)
                        replica = chunk.replica_id
                    assert len(tokens) == MAX_TOKENS, (i, sent, len(tokens))
                    served[replica] += 1
                    sent += 1

            began = time.monotonic()
            load = asyncio.gather(*(client(i) for i in range(5)))
            timings, added = {}, set()
            try:
                while not (added and served[next(iter(added))] >= 3):  # the new replica answered requests
                    assert time.monotonic() - began < WAIT_S, (served, timings)
                    assert not load.done(), load.exception() if load.done() else None
                    if "node" not in timings and len(nodes.alive_node_ips()) > before[0]:
                        timings["node"] = time.monotonic() - began
                    added = await live_replicas(stub) - first
                    if added and "replica" not in timings:
                        timings["replica"] = time.monotonic() - began
                    await asyncio.sleep(1.0)
                timings["traffic"] = time.monotonic() - began
                during = (len(nodes.alive_node_ips()), replicas_on_added_nodes(nodes))
            finally:
                stop.set()
                await load
            idle_at = time.monotonic()
            while "replica_removed" not in timings or "node_removed" not in timings:
                assert time.monotonic() - idle_at < WAIT_S, f"the idle replica or node was not removed: {timings}"
                if "replica_removed" not in timings and len(await live_replicas(stub)) == 1:
                    timings["replica_removed"] = time.monotonic() - idle_at
                if "node_removed" not in timings and len(nodes.alive_node_ips()) == 1:
                    timings["node_removed"] = time.monotonic() - idle_at
                await asyncio.sleep(1.0)
            after = (await live_replicas(stub), replicas_on_added_nodes(nodes))
            reply = await stub.Generate(request("after"), timeout=60).read()
            return first, added, before, during, after, served, timings, reply

    first, added, before, during, after, served, timings, reply = asyncio.run(main())
    print(f"\nhead full by {variant}: nodes alive / replicas on added nodes: before {before}, under load {during}, idle {after[1]}; "
          f"requests per replica {dict(served)}; seconds from the load's start: a node added "
          f"{timings.get('node', float('nan')):.1f}, its replica live {timings['replica']:.1f}, 3 requests answered "
          f"there {timings['traffic']:.1f}; from idle: the replica gone from the directory "
          f"{timings['replica_removed']:.1f}, the node gone {timings['node_removed']:.1f}")
    assert before == (1, 0)  # the head alone, the first replica on it
    assert during[0] >= 2 and during[1] == 1  # a node added, the second replica on it
    assert len(added) == 1 and served[next(iter(added))] >= 3
    assert after[0] == first and after[1] == 0  # idle: back to the head's replica, the added node gone
    assert reply.replica_id in first
