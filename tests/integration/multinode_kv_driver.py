"""The Ray driver of ``test_multinode_kv_transfer.py``: joins the hand-started
nodes (``multinode.py``) as its own process, since the test session may
already hold a local Ray (``ray_local``) and one process holds one Ray.

    python -m tests.integration.multinode_kv_driver '{"scenario": "fetch", ...}'

Prints ``NODE <ip>`` lines as the actors come up and one ``RESULT <json>``
line at the end. The ``kill`` scenario prints ``EXPORTING`` once the doomed
holder pinned the asked blocks, then waits for a line on stdin (the test
kills the holder's node meanwhile) before it collects the answers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import sys
import time

import ray

from cluster.shared.hashing import hash_block_chain, root_hash
from tests.integration.test_kv_transfer_ray import (BLOCK, _sample, checked_replica, lookup, request,
                                                    stalling_replica)
from workers.model.loader import model_fingerprint

logger = logging.getLogger(__name__)


def on_node(cls: type, ip: str, num_cpus: float = 0.25):
    """``cls`` as a Ray actor pinned to the node with IP ``ip`` (its ``node:<ip>`` resource)."""

    class Placed(cls):  # type: ignore[misc, valid-type]
        def node_ip(self) -> str:
            return ray.util.get_node_ip_address()

        def num_ranks(self) -> int:
            return self.kv_transfer.num_ranks

    return ray.remote(num_cpus=num_cpus, resources={f"node:{ip}": 0.01})(Placed)


def config(args: dict) -> dict:
    return {"model": args["model_dir"], "block_size": BLOCK, "num_kv_blocks": 64,
            "kv_transfer_timeout_s": args.get("timeout_s", 10.0), "tensor_parallel_size": args.get("tp", 1)}


def start_replica(args: dict, ip: str, replica_id: str):
    """A replica on node ``ip``; with ``tp`` > 1 it and its ranks in one STRICT_PACK
    placement group there (bundle 0 the replica, one bundle per rank), as Serve places them."""
    tp = args.get("tp", 1)
    actor = on_node(checked_replica(), ip)
    if tp == 1:
        return actor.remote(config(args), args["redis_url"], args["namespace"], replica_id=replica_id), None
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group([{"CPU": 0.25, f"node:{ip}": 0.01}] + [{"CPU": 0.25}] * tp, strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0,
                                                placement_group_capture_child_tasks=True)
    handle = actor.options(scheduling_strategy=strategy).remote(config(args), args["redis_url"], args["namespace"],
                                                                replica_id=replica_id)
    return handle, pg


def bundle_node_ips(pg) -> list[str]:
    """The node IP of each bundle of ``pg`` (the ranks' nodes)."""
    from ray.util import placement_group_table

    by_id = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    bundles = placement_group_table(pg)["bundles_to_node_id"]
    return [by_id[bundles[i]] for i in sorted(bundles)]


def emit(tag: str, payload: object = "") -> None:
    print(tag, json.dumps(payload, default=dataclasses.asdict) if not isinstance(payload, str) else payload, flush=True)


def fetch(args: dict) -> dict:
    """Holder on one worker node, receiver on the other: the receiver fetches the
    prompt's cached prefix by block hash and answers as a local hit does."""
    url, namespace = args["redis_url"], args["namespace"]
    holder, holder_pg = start_replica(args, args["holder_ip"], "mn-holder")
    receiver, receiver_pg = start_replica(args, args["receiver_ip"], "mn-receiver")
    nodes = ray.get([holder.node_ip.remote(), receiver.node_ip.remote()])
    emit("NODE", nodes)
    num_ranks = ray.get([holder.num_ranks.remote(), receiver.num_ranks.remote()])
    rank_nodes = [bundle_node_ips(pg) for pg in (holder_pg, receiver_pg)] if holder_pg is not None else []
    rng = random.Random(7)
    prompt = [rng.randrange(3, 500) for _ in range(27)]  # 6 full blocks of 4 can hit
    cold = ray.get(holder.run.remote(request("h-cold", prompt)))
    local_hit = ray.get(holder.run.remote(request("h-hit", prompt)))
    began = time.monotonic()
    imported = ray.get(receiver.fetch_prefix.remote(holder, prompt))
    fetch_s = time.monotonic() - began
    chain = hash_block_chain(prompt, BLOCK, root_hash(model_fingerprint(args["model_dir"])))
    deadline = time.monotonic() + 20
    while lookup(url, namespace, chain[:6]).get("mn-receiver") != 6 and time.monotonic() < deadline:
        time.sleep(0.1)
    directory = lookup(url, namespace, chain[:6])
    fetched = ray.get(receiver.run.remote(request("r-fetched", prompt)))
    text = ray.get(receiver.metrics_text.remote()).decode()
    holder_text = ray.get(holder.metrics_text.remote()).decode()
    return {"nodes": nodes, "rank_nodes": rank_nodes, "num_ranks": num_ranks, "cold": cold, "local_hit": local_hit, "fetched": fetched, "imported": imported,
            "fetch_s": fetch_s, "directory": directory,
            "blocks_in": _sample(text, "prefixserve:kv_transfer_blocks_total", 'direction="in"'),
            "bytes_in": _sample(text, "prefixserve:kv_transfer_bytes_total", 'direction="in"'),
            "bytes_out": _sample(holder_text, "prefixserve:kv_transfer_bytes_total", 'direction="out"'),
            "integrity": ray.get([holder.check_integrity.remote(), receiver.check_integrity.remote()])}


def kill(args: dict) -> dict:
    """A holder that pins the asked blocks and never answers, on a node the test
    then kills whole; the receiver (another node) must answer by prefill."""
    url, namespace = args["redis_url"], args["namespace"]
    receiver = on_node(checked_replica(), args["receiver_ip"]).remote(config(args), url, namespace,
                                                                      replica_id="mn-receiver-2")
    doomed = on_node(stalling_replica(), args["holder_ip"]).remote(config(args), url, namespace,
                                                                   replica_id="mn-doomed")
    nodes = ray.get([doomed.node_ip.remote(), receiver.node_ip.remote()])
    emit("NODE", nodes)
    rng = random.Random(8)
    prompt, other = [rng.randrange(3, 500) for _ in range(27)], [rng.randrange(3, 500) for _ in range(19)]
    expected = ray.get(doomed.run.remote(request("d-1", prompt)))
    began = time.monotonic()
    fetching = receiver.run.remote(request("d-2", prompt), doomed)  # fetch_and_generate from the doomed holder
    deadline = time.monotonic() + 30
    while not ray.get(doomed.is_exporting.remote()) and time.monotonic() < deadline:
        time.sleep(0.05)
    exporting = ray.get(doomed.is_exporting.remote())
    emit("EXPORTING", {"exporting": exporting})
    sys.stdin.readline()  # the test killed the holder's node
    killed = time.monotonic()
    alongside = receiver.run.remote(request("d-3", other))
    got, beside = ray.get([fetching, alongside], timeout=90)
    done = time.monotonic()
    text = ray.get(receiver.metrics_text.remote()).decode()
    fallbacks = {reason: _sample_or_zero(text, reason) for reason in ("error", "timeout", "busy", "no_room")}
    return {"nodes": nodes, "expected": expected, "got": got, "beside": beside, "fallbacks": fallbacks,
            "kill_to_answer_s": done - killed, "request_s": done - began,
            "integrity": ray.get(receiver.check_integrity.remote())}


def _sample_or_zero(text: str, reason: str) -> float:
    try:
        return _sample(text, "prefixserve:kv_transfer_fallbacks_total", f'reason="{reason}"')
    except AssertionError:
        return 0.0


def main() -> None:
    logging.basicConfig(level=logging.INFO)
    args = json.loads(sys.argv[1])
    ray.init(address=args["address"], logging_level="ERROR")
    try:
        emit("RESULT", {"fetch": fetch, "kill": kill}[args["scenario"]](args))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
