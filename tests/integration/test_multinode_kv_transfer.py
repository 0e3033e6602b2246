"""KV transfer between replicas on different Ray nodes (issue 50 item 6): a
head and two workers started by hand (``multinode.py``, node IPs 127.0.0.1,
.2 and .3, token authentication on), the holder pinned to one worker node
and the receiver to the other (each node's ``node:<ip>`` resource), so the
blocks cross from one node's object store to another's.

- The receiver fetches a cached prefix by block hash: its greedy tokens and
  logprobs equal the holder's local hit (and the cold prefill's tokens), the
  blocks show under the receiver in the real Redis directory, both pass
  ``check_integrity`` with nothing held.
- The holder's node killed whole (SIGKILL of its raylet and every process
  under it) while the receiver awaits its export: the request completes by
  prefill with the same tokens, a request beside it completes, the receiver
  holds no block.

The Ray driver runs in a process of its own (``multinode_kv_driver.py``):
this session may already hold a local Ray.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import uuid

import pytest

from tests.factories import make_tiny_model_dir
from tests.integration.multinode import RayNodes

logger = logging.getLogger(__name__)

HOLDER_IP, RECEIVER_IP = "127.0.0.2", "127.0.0.3"


@pytest.fixture(scope="module")
def nodes():
    with RayNodes(num_workers=2) as started:
        yield started


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("mn-kv-llama"))


def start_driver(nodes: RayNodes, redis_server, model_dir, scenario: str, **extra) -> subprocess.Popen:
    args = {"scenario": scenario, "address": nodes.address, "redis_url": redis_server.url,
            "namespace": f"mnkv-{uuid.uuid4().hex[:6]}", "model_dir": str(model_dir),
            "holder_ip": HOLDER_IP, "receiver_ip": RECEIVER_IP, **extra}
    return subprocess.Popen([sys.executable, "-m", "tests.integration.multinode_kv_driver", json.dumps(args)],
                            env=nodes.client_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def read_until(proc: subprocess.Popen, tag: str, seen: list[str]) -> object:
    """The payload of the driver's next ``tag`` line (its other lines kept in ``seen``)."""
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:])
    proc.wait(timeout=30)
    raise AssertionError(f"the driver ended ({proc.returncode}) without {tag}:\n{''.join(seen)[-6000:]}")


def finish(proc: subprocess.Popen, seen: list[str]) -> dict:
    try:
        result = read_until(proc, "RESULT", seen)
        proc.wait(timeout=60)
        return result
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_prefix_fetched_from_another_node_matches_a_local_hit(nodes, redis_server, model_dir, tp):
    """With ``tp`` 2 each replica and its two ranks are packed on its node, and
    the shards go rank to rank across the nodes."""
    seen: list[str] = []
    got = finish(start_driver(nodes, redis_server, model_dir, "fetch", tp=tp), seen)
    print(f"\nTP {tp}: holder on {got['nodes'][0]}, receiver on {got['nodes'][1]}: {got['imported']} tokens "
          f"({got['bytes_in']:.0f} bytes) fetched across nodes in {got['fetch_s'] * 1000:.0f} ms")
    assert got["nodes"] == [HOLDER_IP, RECEIVER_IP]  # two nodes: the bytes crossed object stores
    assert got["num_ranks"] == [tp, tp]  # rank to rank with tp 2
    if tp > 1:  # every bundle (the replica's, each rank's) on the replica's node
        assert got["rank_nodes"] == [[HOLDER_IP] * (tp + 1), [RECEIVER_IP] * (tp + 1)]
    assert got["imported"] == 24 and got["blocks_in"] == 6
    assert got["bytes_in"] == got["bytes_out"] > 0
    assert got["directory"].get("mn-receiver") == 6  # announced by the receiver's KV events
    fetched, local_hit, cold = got["fetched"], got["local_hit"], got["cold"]
    assert fetched == local_hit and fetched["cached"] == 24  # tokens, logprobs, cached tokens
    assert fetched["tokens"] == cold["tokens"] and cold["cached"] == 0
    assert len(fetched["logprobs"]) == len(cold["logprobs"]) == 6
    for ours, theirs in zip(fetched["logprobs"], cold["logprobs"]):  # a prefill's, to float rounding
        assert ours["token_id"] == theirs["token_id"] and abs(ours["logprob"] - theirs["logprob"]) < 1e-4
        assert [i for i, _ in ours["top_logprobs"]] == [i for i, _ in theirs["top_logprobs"]]
    assert got["integrity"] == [{"used": 0, "held": 0}] * 2


def test_the_holders_node_killed_mid_transfer_costs_a_prefill(nodes, redis_server, model_dir):
    """Last in this module: it kills the holder's node."""
    seen: list[str] = []
    proc = start_driver(nodes, redis_server, model_dir, "kill", timeout_s=5.0)
    try:
        assert read_until(proc, "EXPORTING", seen) == {"exporting": True}, "the holder never began the export"
        node = next(n for n in nodes.nodes if n.ip == HOLDER_IP)
        node.kill()  # the whole node: raylet, object store, the holder's worker
        proc.stdin.write("killed\n")
        proc.stdin.flush()
    except BaseException:
        proc.kill()
        raise
    got = finish(proc, seen)
    print(f"\nholder's node {HOLDER_IP} killed mid-transfer: the request answered by prefill "
          f"{got['kill_to_answer_s']:.1f}s after the kill; fallbacks {got['fallbacks']}")
    assert got["nodes"] == [HOLDER_IP, RECEIVER_IP]
    assert got["got"]["tokens"] == got["expected"]["tokens"] and got["got"]["cached"] == 0
    assert len(got["beside"]["tokens"]) == 6
    assert sum(got["fallbacks"].values()) == 1 and got["fallbacks"]["error"] + got["fallbacks"]["timeout"] == 1
    assert got["integrity"] == {"used": 0, "held": 0}
