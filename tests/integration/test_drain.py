"""Graceful shutdown of ``prefixserve up``: SIGTERM while streams run; the
routers stop accepting work, every running stream still ends with all its
tokens, and the launcher exits 0."""

from __future__ import annotations

import asyncio
import re
import signal

import grpc
import pytest

from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc
from tests.factories import make_tiny_model_dir
from tests.integration.up_process import start_up, wait_for_log

MAX_TOKENS = 500  # one at a time (--max-num-seqs 1): the drain outlasts uvicorn's and gRPC's 5 s defaults


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("drain-llama"))


def test_sigterm_drains_running_streams(model_dir, tmp_path):
    proc, log = start_up(tmp_path / "up.log", "--replicas", "1", "--model", str(model_dir), "--block-size", "4",
                         "--num-kv-blocks", "800", "--replica-num-cpus", "0.25", "--max-num-seqs", "1",
                         "--max-num-batched-tokens", "64", "--grpc-port", "0", "--http-port", "0")
    try:
        text = wait_for_log(proc, log, "ready: gRPC on")
        address = re.search(r"ready: gRPC on (127\.0\.0\.1:\d+)", text).group(1)

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
                        started.set()  # one runs, three wait in the replica's queue
                    return tokens, finish

                tasks = [asyncio.ensure_future(run(i)) for i in range(4)]
                await asyncio.wait_for(started.wait(), 120)
                await asyncio.sleep(0.5)  # all four have reached the replica
                proc.send_signal(signal.SIGTERM)
                return await asyncio.wait_for(asyncio.gather(*tasks), 240)

        results = asyncio.run(main())
        assert results == [(MAX_TOKENS, "length")] * 4
        assert proc.wait(timeout=180) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log.seek(0)
    text = log.read()
    assert "draining the routers" in text and "cluster stopped" in text, text[-3000:]
