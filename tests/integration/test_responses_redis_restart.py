"""A stored conversation through ``prefixserve up --redis-data-dir`` survives its
Redis crashing: while Redis is down stored requests are 503, and once it is back
(on its port, from its append-only file) the conversation continues where it was."""

from __future__ import annotations

import os
import re
import signal
import time

import openai
import psutil
import pytest

from cluster.launch.redis_server import RedisServer
from tests.integration.up_process import running_up

BACK_WITHIN_S = 60.0


def _redis_child(pid: int) -> psutil.Process:
    (redis,) = [p for p in psutil.Process(pid).children(recursive=True) if p.name() == "redis-server"]
    return redis


def test_a_stored_conversation_continues_once_redis_is_back(tmp_path):
    data_dir = tmp_path / "redis-data"
    with running_up(tmp_path / "up.log", "--redis-data-dir", str(data_dir), "--block-size", "16",
                    "--replica-num-cpus", "0.5", "--grpc-port", "0", "--http-port", "0") as (proc, text):
        base = re.search(r"OpenAI HTTP on (http://127\.0\.0\.1:\d+/v1)", text).group(1)
        with openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120) as client:
            first = client.responses.create(input="Say hello.", temperature=0, max_output_tokens=4)
            time.sleep(1.5)  # appendfsync everysec: a crash loses at most the last second
            redis = _redis_child(proc.pid)
            port = int(re.search(r":(\d+)", " ".join(redis.cmdline())).group(1))
            os.kill(redis.pid, signal.SIGKILL)
            for _ in range(100):  # not our child: poll until it is gone (or a zombie of up's)
                if not redis.is_running() or redis.status() == psutil.STATUS_ZOMBIE:
                    break
                time.sleep(0.1)
            with pytest.raises(openai.APIStatusError) as err:
                client.responses.create(input="Again.", previous_response_id=first.id, max_output_tokens=4)
            assert err.value.status_code == 503, err.value.message

            server = RedisServer(port=port, data_dir=data_dir).start()  # the same port, the same file
            try:
                deadline, second = time.monotonic() + BACK_WITHIN_S, None
                while second is None:
                    try:
                        second = client.responses.create(input="And once more?", previous_response_id=first.id,
                                                         temperature=0, max_output_tokens=4)
                    except openai.APIStatusError as exc:
                        assert exc.status_code == 503 and time.monotonic() < deadline, exc.message
                        time.sleep(0.5)
                assert second.usage.input_tokens >= first.usage.input_tokens + first.usage.output_tokens
                assert client.responses.retrieve(first.id).output_text == first.output_text
                assert client.responses.retrieve(second.id).output_text == second.output_text
            finally:
                server.stop()
