"""``prefixserve up`` as a user runs it: starts Ray, redis-server and two
replicas on loopback, serves a prompt through Serve, and on SIGTERM stops
with no process left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from tests.factories import make_tiny_model_dir
from tests.integration.up_process import start_up, wait_for_log


def still_alive(pids: list[int]) -> list[str]:
    alive = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid} {' '.join(proc.cmdline())[:120]}")
        except psutil.Error:
            pass
    return alive


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("up-llama"))


def test_up_serves_and_stops_cleanly_on_sigterm(model_dir, tmp_path):
    proc, log = start_up(tmp_path / "up.log", "--replicas", "2", "--model", str(model_dir), "--block-size", "4",
                         "--kv-cache-memory", "0.01", "--swap-space", "0.01", "--replica-num-cpus", "0.25",
                         "--prompt", "hello world", "--max-tokens", "4", "--grpc-port", "0", "--http-port", "0",
                         stdout=subprocess.PIPE)
    try:
        text = wait_for_log(proc, log, "replica=")
        assert "ready: gRPC on" in text and "start-up" in text, text[-3000:]
        assert "replica=" in text and "finish_reason=length" in text, text[-3000:]
        # The OpenAI-compatible API answers through the cluster.
        url = re.search(r"OpenAI HTTP on (http://127\.0\.0\.1:\d+/v1)", text).group(1)
        body = json.dumps({"prompt": "hello world", "max_tokens": 3, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/completions", body, {"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert reply["usage"]["completion_tokens"] == 3 and reply["choices"][0]["finish_reason"] == "length"
        assert re.search(r"gRPC on 127\.0\.0\.1:\d+", text)
        # Everything `up` started: Ray's GCS, raylet, workers, replicas, redis-server.
        tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        names = " ".join(p.name() for p in psutil.Process(proc.pid).children(recursive=True))
        assert "redis-server" in names and "raylet" in names, names
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log.seek(0)
    assert "cluster stopped" in log.read()
    leftovers = []
    for _ in range(40):  # Ray's processes exit a moment after the driver
        leftovers = still_alive(tree)
        if not leftovers:
            break
        time.sleep(0.5)
    assert not leftovers, leftovers


def test_up_without_redis_server_says_how_to_install(model_dir, tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # no redis-server on PATH
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "up", "--model", str(model_dir), "--exit-after-prompt"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode != 0
    assert "apt-get install -y redis-server" in proc.stderr
    assert "--redis-url" in proc.stderr
