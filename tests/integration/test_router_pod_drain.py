"""A router pod stopping in Kubernetes: its preStop hook, run exactly as the
rendered manifest spells it, drains the router replica (a real Serve
deployment on local Ray) before SIGTERM would reach Ray.

While the hook runs, health is NOT_SERVING and new calls get UNAVAILABLE
("draining: retry"); every stream that was running ends with all its
tokens; the hook exits 0 once none is left, within the manifest's timeout,
which the pod's grace period exceeds."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.app import ROUTER_DEPLOYMENT, build_app
from cluster.shared.config import ClusterConfig, EngineConfig, RouterConfig
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc
from tests.deploy.kustomize import render
from tests.factories import make_tiny_model_dir

APP = "router-pod-drain"
MAX_TOKENS = 300
NUM_STREAMS = 6  # max_num_seqs 1: they run one after another, seconds in all, so the drain sees them running


def router_pod_hook() -> tuple[list[str], int]:
    """The routers group's preStop command and grace period, from the rendered base."""
    from pathlib import Path

    objects = render(Path(__file__).resolve().parents[2] / "deploy" / "kuberay" / "base")
    (rayservice,) = [o for o in objects if o["kind"] == "RayService"]
    (group,) = [g for g in rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"] if g["groupName"] == "routers"]
    pod = group["template"]["spec"]
    (container,) = pod["containers"]
    return container["lifecycle"]["preStop"]["exec"]["command"], pod["terminationGracePeriodSeconds"]


@pytest.fixture(scope="module")
def router(ray_local, redis_server, tmp_path_factory):
    from ray import serve

    tmp = tmp_path_factory.mktemp("pod-drain")
    socket = str(tmp / "router.sock")
    engine = EngineConfig.from_kwargs(model=str(make_tiny_model_dir("llama", tmp)), block_size=4, num_kv_blocks=800,
                                      max_num_seqs=1, max_num_batched_tokens=64)
    config = ClusterConfig(
        replicas=1, replica_num_cpus=0.25, redis_url=redis_server.url, namespace=f"pd-{uuid.uuid4().hex[:6]}",
        engine=engine, router=RouterConfig(grpc_port=0, http_port=None, router_num_cpus=0.25, admin_socket=socket),
    )
    serve.start(proxy_location="Disabled")
    serve.run(build_app(config, with_router=True), name=APP, route_prefix=None)
    try:
        handle = serve.get_deployment_handle(ROUTER_DEPLOYMENT, app_name=APP)
        yield handle.addresses.remote().result(timeout_s=30)["grpc"], socket
    finally:
        serve.delete(APP)


def test_prestop_hook_drains_the_router_pod(router):
    address, socket = router
    command, grace_s = router_pod_hook()
    assert command[:2] == ["prefixserve", "router-drain"]
    timeout_s = float(command[command.index("--timeout") + 1])
    assert grace_s > timeout_s + 10  # SIGTERM to Ray, and its own shutdown, come after the hook
    argv = [sys.executable, "-m", "cluster.cli", *command[1:]]
    argv[argv.index("--socket") + 1] = socket  # the test's socket path, everything else as the pod runs it

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            started = asyncio.Event()

            async def run(i: int):
                request = pb.GenerateRequest(
                    prompt_token_ids=pb.TokenIds(ids=[5 + i, 9, 12, 40 + i]),
                    sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
                tokens, finish = 0, ""
                async for chunk in stub.Generate(request, timeout=240):
                    tokens += len(chunk.token_ids)
                    finish = chunk.finish_reason or finish
                    started.set()
                return tokens, finish

            tasks = [asyncio.ensure_future(run(i)) for i in range(NUM_STREAMS)]
            await asyncio.wait_for(started.wait(), 120)
            await asyncio.sleep(0.3)  # all have reached the router
            hook = await asyncio.create_subprocess_exec(*argv)
            health_stub = health_pb2_grpc.HealthStub(channel)
            for _ in range(100):  # NOT_SERVING while the streams still run
                status = (await health_stub.Check(health_pb2.HealthCheckRequest(), timeout=10)).status
                if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
                await asyncio.sleep(0.05)
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert not all(t.done() for t in tasks), "the streams ended before the drain was seen"
            with pytest.raises(grpc.aio.AioRpcError) as info:
                late = pb.GenerateRequest(prompt="late", sampling=pb.SamplingParams(max_tokens=2))
                await stub.Generate(late, timeout=30).read()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in info.value.details()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 240)
            return results, await asyncio.wait_for(hook.wait(), timeout_s + 30)

    results, rc = asyncio.run(main())
    assert results == [(MAX_TOKENS, "length")] * NUM_STREAMS
    assert rc == 0  # no stream was left when the hook returned
    # A second request over the socket is answered too (a retried hook), with nothing left to drain.
    again = subprocess.run(argv, timeout=60)
    assert again.returncode == 0
