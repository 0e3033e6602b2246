"""A worker node lost whole mid-stream (its raylet, object store, workers and
replica SIGKILLed at once) on three hand-started Ray nodes
(``tests/integration/multinode.py``): every stream of its replica finishes
on the replica of another node with the tokens of an undisturbed run, and
Serve brings the replica count back on the nodes that remain once Ray
declares the node dead. Prints the time from the kill to the last stream's
end and to two live replicas again. Then a node that stalls instead
(its processes SIGSTOPped): its streams go silent and migrate to another
node after the routers' stall timeout, with the same tokens; its replica
leaves the directory once its heartbeats lapse. Last, the node killed first
starts again with its node IP and takes the replica that had no room."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections import Counter

import grpc
import psutil
import pytest

from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc
from tests.factories import make_tiny_model_dir
from tests.integration.multinode import HEAD_IP, RayNodes
from tests.integration.up_process import start_up, stop_up, wait_for_log

NUM_STREAMS = 6
MAX_TOKENS = 160
STALL_TIMEOUT_S = 3.0  # the routers' stall_timeout_s here (default 20 s)
GONE: dict = {}  # what the tests before left dead, for the node's-return test


def request(i: int) -> pb.GenerateRequest:
    ids = [7 + i, 11, 13 + 2 * i, 17, 19, 23 + i]
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))


async def live_replicas(stub) -> dict[str, str]:
    """``{replica_id: node IP}`` of the replicas the directory holds live."""
    reply = await stub.ListReplicas(pb.ListReplicasRequest(), timeout=30)
    return {r.replica_id: r.node for r in reply.replicas}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model_dir = make_tiny_model_dir("llama", tmp_path_factory.mktemp("loss-model") / "tiny")
    with RayNodes(num_workers=2) as nodes:
        proc, log = start_up(tmp_path_factory.mktemp("loss-up") / "up.log", "--address", nodes.address,
                             "--replicas", "2", "--max-replicas-per-node", "1", "--routing-policy", "least_load",
                             "--model", str(model_dir), "--block-size", "4", "--kv-cache-memory", "0.02",
                             "--swap-space", "0.01", "--replica-num-cpus", "0.25", "--grpc-port", "0",
                             "--http-port", "-1", "--stall-timeout-s", str(STALL_TIMEOUT_S),
                             env=nodes.client_env())
        try:
            text = wait_for_log(proc, log, "ready: gRPC on")
            yield nodes, re.search(r"gRPC on (127\.0\.0\.1:\d+)", text).group(1)
        finally:
            stop_up(proc, log)


def test_a_worker_node_killed_mid_stream_loses_no_stream(cluster):
    nodes, address = cluster

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.GenerationStub(channel)

            async def run(i, progress=None):
                tokens, replicas, finishes = [], [], []
                async for chunk in stub.Generate(request(i), timeout=300):
                    tokens.extend(chunk.token_ids)
                    replicas.append(chunk.replica_id)
                    if chunk.finish_reason:
                        finishes.append(chunk.finish_reason)
                    if progress is not None:
                        progress[i] = (len(tokens), chunk.replica_id)
                return tokens, replicas, finishes, time.monotonic()

            reference = await asyncio.gather(*(run(i) for i in range(NUM_STREAMS)))
            where = await live_replicas(stub)
            progress: dict[int, tuple[int, str]] = {}
            tasks = [asyncio.ensure_future(run(i, progress)) for i in range(NUM_STREAMS)]
            deadline = time.monotonic() + 120
            while len(progress) < NUM_STREAMS or min(n for n, _ in progress.values()) < 3:
                assert time.monotonic() < deadline, progress
                assert not any(t.done() for t in tasks), "a stream ended before the fault"
                await asyncio.sleep(0.01)
            on = Counter(replica for _, replica in progress.values())
            # The busiest replica on a worker node (the head holds the GCS and this test's `up`).
            victim = max((r for r in on if where.get(r) not in ("", HEAD_IP)), key=lambda r: on[r])
            node = next(n for n in nodes.nodes if n.ip == where[victim])
            streamed = sum(n for n, _ in progress.values())
            killed_at = time.monotonic()
            node.kill()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 300)
            last_end = max(r[3] for r in results) - killed_at
            while True:  # Ray declares the node dead, Serve starts a replica elsewhere, it registers
                now = await live_replicas(stub)
                if len(now) == 2 and victim not in now and all(now.values()) and node.ip not in now.values():
                    break
                assert time.monotonic() - killed_at < 150, now
                await asyncio.sleep(1.0)
            recovered = time.monotonic() - killed_at
            while node.ip in nodes.alive_node_ips():  # Ray's own verdict comes later (its health checks)
                assert time.monotonic() - killed_at < 150
            dead = time.monotonic() - killed_at
            return reference, results, victim, on[victim], node.ip, streamed, last_end, recovered, dead, where, now

    reference, results, victim, count, ip, streamed, last_end, recovered, dead, before, after = asyncio.run(main())
    GONE["victim"] = victim
    print(f"\nreplicas before {before}; killed node {ip} running {count} of {NUM_STREAMS} streams "
          f"({streamed} tokens streamed); last stream ended {last_end:.1f}s after the kill; two replicas "
          f"again after {recovered:.1f}s: {after}; Ray marked the node dead within {dead:.0f}s")
    assert count >= 1 and streamed < NUM_STREAMS * MAX_TOKENS  # it died mid-stream, running streams
    migrated = 0
    for (ref_tokens, _, ref_finish, _), (tokens, replicas, finishes, _) in zip(reference, results):
        assert tokens == ref_tokens and len(tokens) == MAX_TOKENS and finishes == ref_finish == ["length"]
        if replicas[0] == victim:
            assert replicas[-1] != victim
            migrated += 1
    assert migrated == count


def test_a_stalled_nodes_streams_migrate_and_new_requests_avoid_it(cluster):
    """After the test above: replicas on the head and on one worker; that worker stalls
    (SIGSTOP). The streams on its replica go silent; after STALL_TIMEOUT_S the router
    cancels them there and migrates them to the head's replica: every stream ends OK
    with the tokens of an undisturbed run, well within its deadline."""
    from cluster.shared.directory import DEFAULT_TTL_S

    nodes, address = cluster
    deadline_s = 60.0

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.GenerationStub(channel)

            async def run(i, progress=None, first=None):
                began, replicas, tokens = time.monotonic(), [], []
                try:
                    async for chunk in stub.Generate(request(i), timeout=deadline_s):
                        replicas.append(chunk.replica_id)
                        tokens.extend(chunk.token_ids)
                        if progress is not None:
                            progress[i] = len(replicas)
                            first.setdefault(i, chunk.replica_id)
                    return "OK", time.monotonic() - began, replicas, tokens, time.monotonic()
                except grpc.aio.AioRpcError as exc:
                    return exc.code().name, time.monotonic() - began, replicas, tokens, time.monotonic()

            test_began = time.monotonic()
            where = await live_replicas(stub)
            stalled = next(r for r, ip in where.items() if ip not in ("", HEAD_IP))
            node = next(n for n in nodes.nodes if n.ip == where[stalled])
            for attempt in range(5):  # until the router put at least one stream on the replica to stall
                indices = range(attempt * NUM_STREAMS, (attempt + 1) * NUM_STREAMS)
                progress: dict[int, int] = {}
                first: dict[int, str] = {}
                tasks = [asyncio.ensure_future(run(i, progress, first)) for i in indices]
                while len(progress) < NUM_STREAMS or min(progress.values()) < 3:  # all streaming
                    assert not any(t.done() for t in tasks), "a stream ended before the stall"
                    await asyncio.sleep(0.01)
                if stalled in first.values():
                    break
                await asyncio.gather(*tasks)  # all on the other replica (prefix and load routing): again
            stopped_at = time.monotonic()
            print(f"\nstreams on the replica to stall after {attempt + 1} round(s), "
                  f"{stopped_at - test_began:.1f}s into the test")
            for proc in node.processes():
                try:
                    proc.send_signal(signal.SIGSTOP)
                except psutil.Error:
                    pass
            try:
                during = await asyncio.gather(*tasks)
                last_end = max(r[4] for r in during) - stopped_at
                # The same prompts again as new requests, at once: the directory may still list the
                # stalled replica (and its cached prefixes), but the router saw it stall.
                rerun_at = time.monotonic() - stopped_at
                reference = await asyncio.gather(*(run(i) for i in indices))
                print(f"undisturbed rerun from {rerun_at:.1f}s after the SIGSTOP (code, seconds): "
                      f"{[(r[0], round(r[1], 1)) for r in reference]}")
                while stalled in await live_replicas(stub):
                    assert time.monotonic() - stopped_at < DEFAULT_TTL_S + 30
                    await asyncio.sleep(0.5)
                dropped = time.monotonic() - stopped_at
            finally:
                node.kill()  # SIGKILL ends stopped processes too; `up` then stops without waiting on them
                GONE.update(stalled_replica=stalled, stalled_killed_at=time.monotonic())
            return where, stalled, node.ip, during, last_end, dropped, reference

    where, stalled, ip, during, last_end, dropped, reference = asyncio.run(main())
    migrated = [r for r in during if r[2] and r[2][0] == stalled]
    print(f"\nreplicas {where}; stalled node {ip}; streams during the stall (code, seconds, migrated): "
          f"{[(c, round(s, 1), r[0] == stalled) for c, s, r, _, _ in during]}; the last ended {last_end:.1f}s "
          f"after the SIGSTOP (stall timeout {STALL_TIMEOUT_S:g}s); its replica left the directory after "
          f"{dropped:.1f}s")
    assert migrated  # some ran on the stalled replica
    for code, seconds, replicas, tokens, _ in during:  # every stream finished, none near its deadline
        assert code == "OK" and seconds < deadline_s / 2, (code, seconds)
    for code, _, replicas, tokens, _ in migrated:
        assert replicas[-1] != stalled  # it finished on the other node
    for (_, _, _, tokens, _), (ref_code, ref_seconds, ref_replicas, ref_tokens, _) in zip(during, reference):
        assert ref_code == "OK" and tokens == ref_tokens and len(tokens) == MAX_TOKENS
        assert stalled not in ref_replicas and ref_seconds < deadline_s / 2  # new requests avoid it
    # Its replica leaves the directory once its heartbeats lapse (TTL). Serve's
    # request router still lists it until Serve's own health check fails
    # (health_check_timeout_s 60), but our request router routes only to
    # replicas the directory lists as live: every new request goes elsewhere.
    assert dropped < DEFAULT_TTL_S + 10


def test_a_killed_node_that_returns_gets_a_replica_again(cluster):
    """After the tests above: both worker nodes were killed, the head's replica is
    the only one, and Serve's replacement has no room (one replica per node). The
    node killed first starts again (``ray start`` with its node IP): the
    replacement starts there, registers, and the directory lists exactly the two
    live replicas, nothing of the dead ones."""
    nodes, address = cluster
    if "stalled_replica" not in GONE:
        pytest.skip("runs after the node-loss and stall tests of this module")
    alive = nodes.alive_node_ips()
    ip = next(n.ip for n in nodes.nodes if n.ip != HEAD_IP and n.ip not in alive)  # Ray declared it dead
    began = time.monotonic()
    nodes.restart(ip)
    node_back = time.monotonic() - began

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            while True:
                now = await live_replicas(stub)
                if sorted(now.values()) == [HEAD_IP, ip]:
                    break
                assert time.monotonic() - began < 120, now
                await asyncio.sleep(0.5)
            placed = time.monotonic() - began
            reply = await stub.Generate(request(0), timeout=60).read()  # it answers (first chunk)
            return now, placed, reply

    now, placed, reply = asyncio.run(main())
    print(f"\nnode {ip} back: ray start took {node_back:.1f}s; a replica on it live in the directory "
          f"{placed:.1f}s after the restart began ({time.monotonic() - GONE['stalled_killed_at']:.0f}s after the "
          f"stalled node's kill): {now}")
    assert GONE["stalled_replica"] not in now and GONE.get("victim") not in now
    assert reply.replica_id in now
