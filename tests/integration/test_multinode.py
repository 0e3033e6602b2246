"""``prefixserve up --address`` onto three Ray nodes started by hand (a head
and two workers with node IPs 127.0.0.1, .2 and .3, token authentication on;
``tests/integration/multinode.py``): two replicas land on two different
nodes, both front ends answer, a repeated prefix is served from cache (the
replica on another node published its KV events to the Redis ``up``
started), and stopping ``up`` deletes only its Serve application: the Ray
cluster keeps its three nodes. Two models with ``--max-replicas-per-node 1``:
each model's two replicas on two nodes, both answer, both applications
deleted on stop."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import grpc
import psutil
import pytest

from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc
from tests.factories import make_tiny_model_dir
from tests.integration.multinode import RayNodes
from tests.integration.up_process import start_up, stop_up, wait_for_log

NUM_TOKENS = 6
# Long enough for many full blocks of 4 tokens; each differs from the first character.
PROMPTS = [f"{i} the quick brown fox jumps over the lazy dog while a cluster of nodes serves the prompt "
           f"again and again" for i in range(4)]


def replicas_by_node(nodes: RayNodes, app: str = "prefixserve") -> dict[str, list[int]]:
    """``{node IP: PIDs of the app's Serve replicas in that node's process tree}``."""
    out: dict[str, list[int]] = {}
    for node in nodes.nodes:
        for proc in node.processes():
            try:
                title = " ".join(proc.cmdline())
            except psutil.Error:
                continue
            if "ServeReplica" in title and f":{app}:" in title:
                out.setdefault(node.ip, []).append(proc.pid)
    return out


@pytest.fixture(scope="module")
def nodes():
    began = time.monotonic()
    with RayNodes(num_workers=2) as started:
        print(f"\nthree nodes up in {time.monotonic() - began:.1f}s "
              f"({', '.join(f'{n.ip} {n.start_seconds:.1f}s' for n in started.nodes)})")
        yield started


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("mn-model") / "tiny")


@pytest.fixture(scope="module")
def up(nodes, model_dir, tmp_path_factory):
    """``prefixserve up --address <head> --replicas 2``: yields ``(process, log, HTTP base, gRPC address)``."""
    began = time.monotonic()
    proc, log = start_up(tmp_path_factory.mktemp("mn-up") / "up.log", "--address", nodes.address,
                         "--replicas", "2", "--model", str(model_dir), "--block-size", "4",
                         "--kv-cache-memory", "0.01", "--swap-space", "0.01", "--replica-num-cpus", "0.25",
                         "--grpc-port", "0", "--http-port", "0", env=nodes.client_env())
    try:
        text = wait_for_log(proc, log, "ready: gRPC on")
        print(f"up ready in {time.monotonic() - began:.1f}s")
        base = re.search(r"OpenAI HTTP on (http://127\.0\.0\.1:\d+/v1)", text).group(1)
        address = re.search(r"gRPC on (127\.0\.0\.1:\d+)", text).group(1)
        yield proc, log, base, address
    finally:
        stop_up(proc, log)


def test_up_joins_the_cluster_and_starts_no_ray_of_its_own(nodes, up):
    proc, log, _, _ = up
    log.seek(0)
    text = log.read()
    assert re.search(r"joined the Ray cluster at 127\.0\.0\.1:\d+ as node 127\.0\.0\.1 \(3 nodes alive\)", text), \
        text[-3000:]
    # Its redis-server listens on this node's address, with a password (other nodes reach it).
    assert re.search(r"redis-server on 127\.0\.0\.1:\d+ \(password in its URL\)", text), text[-3000:]
    names = [p.name() for p in psutil.Process(proc.pid).children(recursive=True)]
    assert "redis-server" in names and "raylet" not in names and "gcs_server" not in names, names


def test_two_replicas_land_on_two_different_nodes(nodes, up):
    placement = replicas_by_node(nodes)
    print(f"replicas by node: {placement}")
    assert sum(len(pids) for pids in placement.values()) == 2, placement
    assert len(placement) == 2, f"both replicas on one node: {placement}"
    # Each replica listens on its own node's address (or every address), never another node's loopback.
    for ip, pids in placement.items():
        listening = {c.laddr.ip.removeprefix("::ffff:") for pid in pids for c in psutil.Process(pid).net_connections("inet")
                     if c.status == psutil.CONN_LISTEN}
        print(f"replica on {ip} listens on {sorted(listening)}")
        assert listening and listening <= {ip, "0.0.0.0", "::"}, (ip, listening)


def test_status_shows_the_node_of_each_replica(nodes, up):
    """``prefixserve status`` names the node each replica reported with its heartbeat."""
    placement = replicas_by_node(nodes)
    deadline = time.monotonic() + 30
    while True:
        out = subprocess.run([sys.executable, "-m", "cluster.cli", "status", "--url", up[3]], capture_output=True,
                             text=True, timeout=60)
        table = out.stdout.splitlines()
        shown = sorted(line.split()[1] for line in table[1:-1]) if table and "node" in table[0] else []
        if shown == sorted(placement) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    print("\n".join(table))
    assert table[0].split()[:2] == ["replica", "node"] and shown == sorted(placement), out.stdout + out.stderr


def test_answers_over_the_openai_api_and_grpc(up):
    import openai

    _, _, base, address = up
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    reply = client.completions.create(model=model, prompt="hello world", max_tokens=NUM_TOKENS, temperature=0)
    assert reply.usage.completion_tokens == NUM_TOKENS and reply.choices[0].finish_reason == "length"
    with grpc.insecure_channel(address) as channel:
        request = pb.GenerateRequest(prompt="hello world",
                                     sampling=pb.SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0))
        text = "".join(r.text for r in pb_grpc.GenerationStub(channel).Generate(request, timeout=120))
    assert text == reply.choices[0].text  # greedy: the same tokens, whichever node answered


def test_a_repeated_prefix_is_served_from_cache_across_nodes(up):
    """The second copy of each prompt goes to the replica that holds its
    blocks (known only through the directory its KV events fed): with
    load-only routing over two replicas all four would hit by chance 1 in 16."""
    import openai

    _, _, base, _ = up
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id

    def cached(prompt: str) -> tuple[int, int]:
        usage = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0).usage
        return usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens

    first = [cached(p) for p in PROMPTS]
    assert all(hit == 0 for _, hit in first), first
    time.sleep(2.0)  # the replicas' KV events reach Redis and the router's index
    second = [cached(p) for p in PROMPTS]
    print(f"prompt tokens / cached tokens, second copies: {second}")
    assert all(hit >= prompt // 2 for prompt, hit in second), second


def test_stop_deletes_only_its_application_and_ray_keeps_running(nodes, up):
    proc, log, _, _ = up
    redis = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name() == "redis-server"]
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    print(f"up stopped in {time.monotonic() - began:.1f}s")
    log.seek(0)
    text = log.read()
    assert "deleted Serve application prefixserve" in text and "cluster stopped" in text, text[-3000:]
    assert not replicas_by_node(nodes)  # Serve removed the replicas ...
    assert nodes.alive_node_ips() == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]  # ... and Ray still has its nodes
    assert not [p for p in redis if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_two_models_each_at_most_one_replica_per_node(nodes, up, tmp_path):
    """After the first ``up`` stopped (the test above): two models, two
    replicas each, capped at one per node by Serve's max_replicas_per_node."""
    import openai

    assert up[0].poll() is not None
    models = {name: make_tiny_model_dir("llama", tmp_path / name, seed=seed)
              for name, seed in (("alpha", 1), ("beta", 2))}
    proc, log = start_up(tmp_path / "up.log", "--address", nodes.address, "--model", str(models["alpha"]),
                         "--model", str(models["beta"]), "--replicas", "2", "--max-replicas-per-node", "1",
                         "--block-size", "4", "--kv-cache-memory", "0.01", "--swap-space", "0.01",
                         "--replica-num-cpus", "0.25", "--grpc-port", "0", "--http-port", "0",
                         env=nodes.client_env())
    try:
        text = wait_for_log(proc, log, "ready: gRPC on")
        base = re.search(r"OpenAI HTTP on (http://127\.0\.0\.1:\d+/v1)", text).group(1)
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
        for name in models:
            placement = replicas_by_node(nodes, f"prefixserve-{name}")
            print(f"{name} replicas by node: {placement}")
            assert sorted(len(pids) for pids in placement.values()) == [1, 1], placement
            reply = client.completions.create(model=name, prompt="hello world", max_tokens=NUM_TOKENS, temperature=0)
            assert reply.model == name and reply.usage.completion_tokens == NUM_TOKENS
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        log.seek(0)
        text = log.read()
        assert "deleted Serve application prefixserve-alpha" in text, text[-3000:]
        assert "deleted Serve application prefixserve-beta" in text, text[-3000:]
        assert not replicas_by_node(nodes, "prefixserve-alpha") and not replicas_by_node(nodes, "prefixserve-beta")
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def test_a_tensor_parallel_replica_keeps_its_ranks_on_one_node(nodes, up, model_dir, tmp_path):
    """TP=2: the replica and both rank actors in one placement group packed on
    one node (STRICT_PACK), greedy tokens equal to the offline TP=1 engine's."""
    import openai

    from cluster.shared.types import SamplingParams
    from workers.llm import LLM

    assert up[0].poll() is not None
    with LLM(str(model_dir), block_size=4) as llm:
        expected = llm.generate(["hello world"], SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0))[0].text
    proc, log = start_up(tmp_path / "up.log", "--address", nodes.address, "--model", str(model_dir),
                         "--tensor-parallel-size", "2", "--block-size", "4", "--kv-cache-memory", "0.01",
                         "--swap-space", "0.01", "--replica-num-cpus", "0.25", "--rank-num-cpus", "0.5",
                         "--grpc-port", "0", "--http-port", "0", env=nodes.client_env())
    try:
        text = wait_for_log(proc, log, "ready: gRPC on")
        base = re.search(r"OpenAI HTTP on (http://127\.0\.0\.1:\d+/v1)", text).group(1)
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
        reply = client.completions.create(model="tiny", prompt="hello world", max_tokens=NUM_TOKENS, temperature=0)
        assert reply.choices[0].text == expected
        replica = replicas_by_node(nodes)
        ranks = {}
        for node in nodes.nodes:
            for p in node.processes():
                try:
                    if "RankWorker" in " ".join(p.cmdline()):
                        ranks.setdefault(node.ip, []).append(p.pid)
                except psutil.Error:
                    pass
        print(f"TP=2: replica on {replica}, ranks on {ranks}")
        assert len(replica) == 1 and list(ranks) == list(replica) and len(next(iter(ranks.values()))) == 2
    finally:
        stop_up(proc, log)
