"""Two models served by one ``prefixserve up``: each request reaches its own
model's replicas (greedy tokens equal to that model's offline engine), an
unknown model is refused naming both, the metrics carry both, and killing one
model's replica leaves the other serving."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.error
import urllib.request

import grpc
import psutil
import pytest

from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc
from tests.factories import make_tiny_model_dir
from tests.integration.up_process import running_up

PROMPT = "hello world"
NUM_TOKENS = 8


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=120).read())


def _complete(base: str, model: str) -> list[int]:
    reply = _post(base + "/completions", {"model": model, "prompt": PROMPT, "max_tokens": NUM_TOKENS,
                                           "temperature": 0})
    assert reply["model"] == model and reply["usage"]["completion_tokens"] == NUM_TOKENS
    return reply["choices"][0]["text"]


def _offline_text(model_dir) -> str:
    from cluster.shared.types import SamplingParams
    from workers.llm import LLM

    with LLM(str(model_dir), block_size=4) as llm:
        return llm.generate([PROMPT], SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0))[0].text


def _replica_pids(root_pid: int, app: str) -> list[int]:
    pids = []
    for proc in psutil.Process(root_pid).children(recursive=True):
        try:
            if "ServeReplica" in " ".join(proc.cmdline()) and f":{app}:" in " ".join(proc.cmdline()):
                pids.append(proc.pid)
        except psutil.Error:
            pass
    return pids


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny Llama models with different weights: ``{name: folder}``."""
    return {name: make_tiny_model_dir("llama", tmp_path_factory.mktemp("mm") / name, seed=seed)
            for name, seed in (("alpha", 1), ("beta", 2))}


@pytest.fixture(scope="module")
def served(models, tmp_path_factory):
    """``prefixserve up --model alpha --model beta``: yields ``(process, HTTP base URL, gRPC address)``."""
    log_path = tmp_path_factory.mktemp("mm-up") / "up.log"
    with running_up(log_path, "--model", str(models["alpha"]), "--model", str(models["beta"]),
                    "--block-size", "4", "--kv-cache-memory", "0.01", "--swap-space", "0.01",
                    "--replica-num-cpus", "0.25", "--grpc-port", "0", "--http-port", "0") as (proc, text):
        base = re.search(r"OpenAI HTTP on (http://127\.0\.0\.1:\d+/v1)", text).group(1)
        address = re.search(r"gRPC on (127\.0\.0\.1:\d+)", text).group(1)
        yield proc, base, address


def test_models_lists_both_and_each_request_reaches_its_model(served, models):
    _, base, address = served
    listed = json.loads(urllib.request.urlopen(base + "/models", timeout=30).read())
    assert [m["id"] for m in listed["data"]] == ["alpha", "beta"]
    expected = {name: _offline_text(folder) for name, folder in models.items()}
    assert expected["alpha"] != expected["beta"]  # else routing to the wrong model would pass
    assert {name: _complete(base, name) for name in models} == expected
    # gRPC: GenerateRequest.model picks the model the same way.
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for name in models:
            request = pb.GenerateRequest(prompt=PROMPT, model=name,
                                         sampling=pb.SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0))
            assert "".join(r.text for r in stub.Generate(request, timeout=120)) == expected[name]


def test_an_unknown_model_is_refused_naming_the_served_ones(served):
    _, base, address = served
    with pytest.raises(urllib.error.HTTPError) as err:
        _post(base + "/completions", {"model": "gpt-4", "prompt": PROMPT, "max_tokens": 1})
    assert err.value.code == 404
    assert "this server serves 'alpha', 'beta'" in json.loads(err.value.read())["error"]["message"]
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as rpc:
        list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(prompt=PROMPT, model="gpt-4"), timeout=30))
    assert rpc.value.code() == grpc.StatusCode.NOT_FOUND


def test_list_replicas_names_each_replicas_model(served):
    _, _, address = served
    with grpc.insecure_channel(address) as channel:
        replicas = pb_grpc.GenerationStub(channel).ListReplicas(pb.ListReplicasRequest(), timeout=30).replicas
    assert sorted(r.model for r in replicas) == ["alpha", "beta"]


def test_metrics_carry_both_models(served):
    _, base, _ = served
    for name in ("alpha", "beta"):
        _complete(base, name)
    deadline = time.monotonic() + 60
    text = ""
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(base.removesuffix("/v1") + "/metrics", timeout=30).read().decode()
        replica = [line for line in text.splitlines() if line.startswith("prefixserve:num_requests_running")]
        if {m for line in replica for m in re.findall(r'model="(\w+)"', line)} == {"alpha", "beta"}:
            break
        time.sleep(1)
    assert 'prefixserve:num_requests_running{' in text, text[:2000]
    for name in ("alpha", "beta"):
        assert re.search(r'prefixserve:num_requests_running\{[^}]*model="%s"' % name, text), text[:4000]
        assert re.search(r'prefixserve:router_requests_total\{[^}]*model="%s"' % name, text), text[:4000]


def test_a_model_without_a_live_replica_fails_fast_and_comes_back(served, models):
    """Alpha's only replica stalls (SIGSTOP): once its registration expires, alpha's
    requests get 503 / UNAVAILABLE at once instead of queueing; beta serves throughout."""
    proc, base, address = served
    (pid,) = _replica_pids(proc.pid, "prefixserve-alpha")
    expected_beta = _complete(base, "beta")
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline, refused = time.monotonic() + 60, None
        while refused is None and time.monotonic() < deadline:
            started = time.monotonic()
            try:
                request = urllib.request.Request(
                    base + "/completions", json.dumps({"model": "alpha", "prompt": PROMPT, "max_tokens": 2}).encode(),
                    {"Content-Type": "application/json"})
                urllib.request.urlopen(request, timeout=2)
            except urllib.error.HTTPError as err:
                refused = (err.code, json.loads(err.read())["error"]["message"], time.monotonic() - started)
            except (TimeoutError, urllib.error.URLError):
                pass  # queued behind the stalled replica: not yet known to be gone
            assert _complete(base, "beta") == expected_beta
        assert refused is not None, "alpha's requests never failed fast"
        assert refused[0] == 503 and "'alpha' has no live replica" in refused[1] and refused[2] < 1.0, refused
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as rpc:
            list(pb_grpc.GenerationStub(channel).Generate(
                pb.GenerateRequest(prompt=PROMPT, model="alpha", sampling=pb.SamplingParams(max_tokens=2)),
                timeout=10))
        assert rpc.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while True:  # it registers again with its next heartbeat and answers
        try:
            assert _complete(base, "alpha") == _offline_text(models["alpha"])
            break
        except urllib.error.HTTPError:
            assert time.monotonic() < deadline
            time.sleep(1)


def test_killing_one_models_replica_leaves_the_other_serving(served, models):
    proc, base, _ = served
    alpha_pids = _replica_pids(proc.pid, "prefixserve-alpha")
    assert len(alpha_pids) == 1, [" ".join(p.cmdline())[:100] for p in psutil.Process(proc.pid).children(True)]
    expected_beta = _complete(base, "beta")
    os.kill(alpha_pids[0], signal.SIGKILL)
    for _ in range(3):  # beta answers while alpha's replica is dead or restarting
        assert _complete(base, "beta") == expected_beta
    # Serve brings alpha's replica back; then alpha answers again, the same tokens.
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        pids = _replica_pids(proc.pid, "prefixserve-alpha")
        if pids and pids != alpha_pids:
            break
        time.sleep(1)
    assert _complete(base, "alpha") == _offline_text(models["alpha"])
