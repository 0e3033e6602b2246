"""``bench router``'s front ends: a gRPC router in a child process pinned to
one core (over Serve and the echo replicas, or answering at once), the client
load driven against it from this process, and the child's own CPU time per
request (``cluster/bench/router.py`` has the whole measurement)."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import time
from typing import Any, AsyncIterator, Optional

from cluster.client.table import percentile
from cluster.shared.types import FinishReason, GenerationRequest, StreamChunk

logger = logging.getLogger(__name__)

APP = "bench-router"  # the Serve app of the echo replicas


class _AtOnceBackend:
    """The baseline backend: answers without Serve or routing."""

    def __init__(self, tokenizer: Any, model: Any) -> None:
        self.tokenizer, self.model = tokenizer, model

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        yield StreamChunk(request.request_id, [1], "x", FinishReason.LENGTH,
                          prompt_tokens=len(request.prompt_token_ids), completion_tokens=1, replica_id="at-once")


def _serve_front_end(deployment: Optional[str], model_dir: str, gcs_address: Optional[str], cpu: Optional[int],
                     ready: Any, stop: Any, transport: str = "grpc", segment_cache: bool = True,
                     same_loop: bool = True) -> None:
    """Child process: the gRPC front end over ``deployment`` (None: answers at once) until ``stop`` is set,
    streaming from replicas over ``transport`` and tokenizing with or without the segment cache."""
    logging.basicConfig(level=logging.WARNING)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    from router.backend import ModelInfo, RouterBackend
    from router.server import RouterServer
    from router.tokenizer import RouterTokenizer

    tokenizer = RouterTokenizer.from_model_dir(model_dir)
    if not segment_cache:
        tokenizer.segment_cache = None
    model = ModelInfo("bench", 8192)
    if deployment is not None:
        import ray
        from ray import serve

        ray.init(address=gcs_address, _node_ip_address="127.0.0.1", logging_level=logging.WARNING)
        backend: Any = RouterBackend(serve.get_deployment_handle(deployment, app_name=APP), tokenizer, model,
                                     replica_transport=transport, same_loop=same_loop)
    else:
        backend = _AtOnceBackend(tokenizer, model)

    async def main() -> None:
        server = RouterServer(backend, None, port=0)
        ready.put(await server.start())
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await server.stop(1.0)

    asyncio.run(main())


async def _drive(address: str, prompts: list[str], concurrency: int) -> dict[str, Any]:
    """Sends every prompt (``concurrency`` at a time); returns req/s and latency percentiles."""
    import grpc

    from router.pb import generation_pb2 as pb
    from router.pb import generation_pb2_grpc as pb_grpc

    latencies: list[float] = []
    errors = 0
    queue: asyncio.Queue = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def worker() -> None:
            nonlocal errors
            while not queue.empty():
                prompt = queue.get_nowait()
                began = time.perf_counter()
                try:
                    async for _ in stub.Generate(pb.GenerateRequest(
                            prompt=prompt, sampling=pb.SamplingParams(max_tokens=1)), timeout=60):
                        pass
                    latencies.append(time.perf_counter() - began)
                except grpc.aio.AioRpcError as exc:
                    errors += 1
                    logger.warning("request failed: %s", exc.details())

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - began
    data = sorted(latencies)
    return {"requests": len(prompts), "errors": errors, "seconds": round(seconds, 3),
            "requests_per_s": round(len(data) / seconds, 1),
            "latency_ms": {"p50": round(percentile(data, 50) * 1e3, 3), "p99": round(percentile(data, 99) * 1e3, 3)}}


def run_front_end(deployment: Optional[str], model_dir: str, gcs: Optional[str], prompts: list[str],
                   concurrency: int, warmup: list[str], transport: str = "grpc",
                   segment_cache: bool = True, same_loop: bool = True) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    cpus = sorted(os.sched_getaffinity(0))
    child = ctx.Process(target=_serve_front_end, args=(deployment, model_dir, gcs, cpus[0] if len(cpus) > 1 else None,
                                                       ready, stop, transport, segment_cache, same_loop),
                        daemon=True)
    child.start()
    try:
        port = ready.get(timeout=120)
        address = f"127.0.0.1:{port}"
        asyncio.run(_drive(address, warmup, concurrency))
        logger.info("%s: %d requests, concurrency %d", deployment or "at once", len(prompts), concurrency)
        cpu_before = _cpu_seconds(child.pid)
        result = asyncio.run(_drive(address, prompts, concurrency))
        cpu = _cpu_seconds(child.pid) - cpu_before
        done = max(1, len(prompts) - result["errors"])
        # The front end's own CPU (all its threads): what a request costs the router, whatever the other core does.
        result["router_cpu_ms_per_request"] = round(cpu * 1e3 / done, 3)
        result["requests_per_router_cpu_s"] = round(done / max(cpu, 1e-9), 1)
        return result
    finally:
        stop.set()
        child.join(30)
        if child.is_alive():
            child.kill()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    import psutil

    times = psutil.Process(pid).cpu_times()
    return times.user + times.system
