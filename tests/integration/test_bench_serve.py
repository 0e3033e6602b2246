"""``prefixserve bench serve`` and ``prefixserve status`` against a real
cluster: a tiny model on one Serve replica (so which prompts hit the prefix
cache is known exactly), the real gRPC router and OpenAI HTTP server, Redis.

The benchmark's figures are checked against numbers the test computes on its
own from the dataset: request and token counts, and, with one request in
flight at a time, the exact prefix-cache hits of a shared-prefix workload.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid

import pytest
from tokenizers import Tokenizer

from cluster import cli
from cluster.bench.datasets import multi_turn_dataset, shared_prefix_dataset
from cluster.shared.directory import Directory
from router.backend import ModelInfo, RouterBackend
from router.tokenizer import RouterTokenizer
from tests.factories import CHAT_TEMPLATE, make_tiny_model_dir
from tests.integration.router_cluster import serve_app

APP = "bench-serve"
BLOCK_SIZE = 4
VOCAB = 512  # tests/factories.py TINY
# Shared-prefix workload: the system prompt is whole blocks, so a hit is exactly it.
GROUPS, PER_GROUP, SYSTEM_LEN, QUESTION_LEN, OUTPUT_LEN = 2, 4, 32, 6, 5


@pytest.fixture(scope="module")
def cluster(ray_local, redis_server, tmp_path_factory):
    """One replica with room for every prompt; yields (handle, model_dir, redis_url, namespace)."""
    model_dir = make_tiny_model_dir("llama", tmp_path_factory.mktemp("bench-llama"), max_position_embeddings=1024)
    # A chat template for the structured-output datasets' questions (the fingerprint ignores it).
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}))
    namespace = f"bench-{uuid.uuid4().hex[:6]}"
    with serve_app(APP, model_dir, redis_server.url, namespace, replicas=1, block_size=BLOCK_SIZE,
                   num_kv_blocks=400) as handle:
        yield handle, model_dir, redis_server.url, namespace


@contextlib.contextmanager
def routers(cluster, responses: bool = False):
    """The gRPC router and the OpenAI HTTP server on their own thread's loop
    (as ``prefixserve up`` runs them), so the CLI can run its own loop here.
    ``responses``: /v1/responses stores in Redis and counts its continued turns
    in this process's router metrics. Yields (grpc address, OpenAI base URL)."""
    from router.metrics import ClusterMetrics, get_router_metrics
    from router.openai import serve_openai
    from router.openai.response_store import RedisResponseStore
    from router.server import RouterServer

    handle, model_dir, redis_url, namespace = cluster
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="bench-routers", daemon=True)
    thread.start()

    async def start():
        backend = RouterBackend(handle, RouterTokenizer.from_model_dir(model_dir), ModelInfo("tiny", 1024),
                                metrics=get_router_metrics(namespace, "cache_aware") if responses else None)
        if responses:
            backend.response_store = RedisResponseStore.from_url(redis_url, namespace)
        server = RouterServer(backend, Directory.from_url(redis_url, namespace), port=0)
        await server.start()
        metrics = ClusterMetrics(get_router_metrics(namespace, "cache_aware"), Directory.from_url(redis_url, namespace))
        return server, await serve_openai(backend, port=0, metrics=metrics), backend

    server, http, backend = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=60)
    try:
        yield server.address, http.url
    finally:
        asyncio.run_coroutine_threadsafe(http.stop(), loop).result(timeout=30)
        if responses:
            asyncio.run_coroutine_threadsafe(backend.response_store.aclose(), loop).result(timeout=30)
        asyncio.run_coroutine_threadsafe(server.stop(grace=1.0), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def bench(model_dir, tmp_path, *flags):
    """Runs ``prefixserve bench serve`` in this process; returns its JSON report."""
    out = tmp_path / f"bench-{uuid.uuid4().hex[:6]}.json"
    rc = cli.main(["bench", "serve", "--model", str(model_dir), "--disable-tqdm", "--json", str(out), *flags])
    assert rc == 0
    return json.loads(out.read_text())


def shared_prefix_flags(seed):
    return ["--dataset-name", "shared-prefix", "--seed", str(seed), "--gsp-num-groups", str(GROUPS),
            "--gsp-prompts-per-group", str(PER_GROUP), "--gsp-system-prompt-len", str(SYSTEM_LEN),
            "--gsp-question-len", str(QUESTION_LEN), "--gsp-output-len", str(OUTPUT_LEN),
            "--max-concurrency", "1"]


def check_shared_prefix_figures(report, seed):
    """The report against what the dataset implies, computed here."""
    convs = shared_prefix_dataset(GROUPS, PER_GROUP, SYSTEM_LEN, QUESTION_LEN, OUTPUT_LEN, VOCAB, seed)
    num = len(convs)
    prompt_tokens = sum(len(c.turns[0].new_token_ids) for c in convs)
    # One at a time on one replica: each group's first request misses, every
    # later one hits exactly its system prompt (the question's block is new).
    cached = GROUPS * (PER_GROUP - 1) * SYSTEM_LEN
    assert num == GROUPS * PER_GROUP == report["num_requests"] == report["completed"]
    assert report["failed"] == 0
    assert report["total_input_tokens"] == prompt_tokens == num * (SYSTEM_LEN + QUESTION_LEN)
    assert report["total_output_tokens"] == num * OUTPUT_LEN  # ignore_eos: exact lengths
    assert report["total_cached_prompt_tokens"] == cached
    assert report["prefix_hit_rate"] == round(cached / prompt_tokens, 4)
    assert report["shared_prefix_hit_rate"] == round(cached / (num * SYSTEM_LEN), 4)
    duration = report["duration_s"]
    assert duration > 0
    assert report["request_throughput"] == pytest.approx(num / duration, rel=0.01)
    assert report["output_throughput"] == pytest.approx(num * OUTPUT_LEN / duration, rel=0.01)
    assert report["input_throughput"] == pytest.approx(prompt_tokens / duration, rel=0.01)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        d = report[key]
        assert set(d) == {"mean", "p50", "p95", "p99"}
        assert 0 < d["p50"] <= d["p95"] <= d["p99"], (key, d)
    assert report["ttft_ms"]["p50"] <= report["e2el_ms"]["p50"]
    assert report["e2el_ms"]["p99"] <= duration * 1000


def test_bench_serve_over_grpc_matches_the_workload(cluster, tmp_path):
    with routers(cluster) as (address, _):
        report = bench(cluster[1], tmp_path, "--url", address, *shared_prefix_flags(seed=11),
                       "--goodput", "ttft:600000", "tpot:600000")
    check_shared_prefix_figures(report, seed=11)
    assert report["goodput"]["good_requests"] == report["completed"]  # SLOs of ten minutes: all good
    assert list(report["requests_per_replica"].values()) == [report["completed"]]
    config = report["config"]
    assert config["backend"] == "grpc" and config["dataset_name"] == "shared-prefix" and config["seed"] == 11
    assert config["request_rate"] == "inf" and config["max_concurrency"] == 1


def test_a_local_clusters_run_splits_its_ttft_between_the_path_and_the_replicas(cluster, tmp_path, monkeypatch):
    # bench serve without --url starts a local cluster and reads its replicas' own TTFT
    # (cluster/bench/ttft_split.py); here the cluster is this module's, started already.
    from types import SimpleNamespace

    from cluster.bench import serve as serve_module

    _, model_dir, redis_url, namespace = cluster
    with routers(cluster) as (address, _):
        running = SimpleNamespace(grpc_address=address, redis_url=redis_url, stop=lambda: None,
                                  config=SimpleNamespace(models_by_name=lambda: {"tiny": SimpleNamespace(
                                      namespace=namespace)}))
        monkeypatch.setattr(serve_module, "start_local_cluster", lambda *args, **kwargs: running)
        report = bench(model_dir, tmp_path, *shared_prefix_flags(seed=13))
    parts = report["ttft_split"]
    assert parts["requests"] == report["completed"] == GROUPS * PER_GROUP  # the run's, not the warm-up's
    assert parts["client_ttft_mean_ms"] == report["ttft_ms"]["mean"]
    # A replica's interval lies inside the client's: receipt to first token, queue inside that.
    assert 0 < parts["replica_ttft_mean_ms"] < parts["client_ttft_mean_ms"], parts
    assert 0 <= parts["replica_queue_mean_ms"] <= parts["replica_ttft_mean_ms"], parts
    assert parts["path_mean_ms"] == pytest.approx(parts["client_ttft_mean_ms"] - parts["replica_ttft_mean_ms"])
    assert 0 < parts["replica_itl_mean_ms"] < report["e2el_ms"]["mean"]  # the replicas' gaps between tokens
    # One replica, fetches unpriced: the replicas' transfer figures are read, and zero.
    assert report["kv_transfers"]["fetches"] == 0 and report["kv_transfers"]["mb_in"] == 0.0


def test_rounds_restart_the_local_cluster_between_runs_of_the_engine_alone(cluster, tmp_path, monkeypatch):
    # --rounds 2: engine, cluster, engine, cluster, engine; each round against the engine runs around it.
    from types import SimpleNamespace

    from cluster.bench import serve as serve_module

    _, model_dir, redis_url, namespace = cluster
    starts, stops = [], []
    with routers(cluster) as (address, _):
        def start(*args, **kwargs):
            starts.append(1)
            return SimpleNamespace(grpc_address=address, redis_url=redis_url, stop=lambda: stops.append(1),
                                   config=SimpleNamespace(models_by_name=lambda: {"tiny": SimpleNamespace(
                                       namespace=namespace)}))

        monkeypatch.setattr(serve_module, "start_local_cluster", start)
        report = bench(model_dir, tmp_path, "--dataset-name", "random", "--num-prompts", "3", "--random-input-len",
                       "24", "--random-output-len", "4", "--max-concurrency", "1", "--engine-baseline",
                       "--rounds", "2", "--num-kv-blocks", "256", "--block-size", "4")
    assert len(starts) == len(stops) == 2
    assert report["completed"] == 6 and report["ttft_split"]["requests"] == 6  # both rounds' requests
    base = report["engine_baseline"]
    assert len(base["runs"]) == 3 and len(base["rounds"]) == 2 == len(report["rounds"])
    for r, (run, ratios) in enumerate(zip(report["rounds"], base["rounds"])):
        step = (base["runs"][r]["step_ms"] + base["runs"][r + 1]["step_ms"]) / 2
        assert ratios["itl_p50_over_step"] == pytest.approx(run["itl_ms"]["p50"] / step)
    values = sorted(r["output_throughput_over_engine"] for r in base["rounds"])
    assert base["output_throughput_over_engine_range"] == values
    assert base["output_throughput_over_engine"] == pytest.approx(sum(values) / 2)  # the median of two


def test_bench_serve_over_openai_matches_the_workload(cluster, tmp_path):
    with routers(cluster) as (_, base_url):
        report = bench(cluster[1], tmp_path, "--backend", "openai", "--base-url", base_url,
                       *shared_prefix_flags(seed=12))
    check_shared_prefix_figures(report, seed=12)
    assert report["config"]["backend"] == "openai"


@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_multi_turn_prompts_grow_and_hit_the_previous_turn(cluster, tmp_path, backend):
    from cluster.bench.serve import run_requests
    from cluster.bench.serve_setup import make_client

    convs = multi_turn_dataset(6, 3, 20, 6, 5, VOCAB, seed=13 if backend == "grpc" else 14)
    tokenizer = Tokenizer.from_file(str(cluster[1] / "tokenizer.json")) if backend == "openai" else None

    async def main(target):
        client = make_client(backend, target, tokenizer)
        try:
            return await run_requests(client, convs, max_concurrency=1, progress=False)
        finally:
            await client.aclose()

    with routers(cluster) as (address, base_url):
        records, _ = asyncio.run(main(address if backend == "grpc" else base_url))
    assert len(records) == 6 and all(r.ok for r in records), [r.error for r in records]
    by_conv = {}
    for r in sorted(records, key=lambda r: (r.conversation, r.turn)):
        by_conv.setdefault(r.conversation, []).append(r)
    for turns in by_conv.values():
        assert [r.turn for r in turns] == [0, 1, 2]
        assert turns[0].prompt_len == 20
        for prev, cur in zip(turns, turns[1:]):
            assert cur.prompt_tokens == cur.prompt_len  # the server saw the prompt we built
            if backend == "grpc":  # exactly previous prompt + its answer + the new question
                assert cur.prompt_len == prev.prompt_len + OUTPUT_LEN + 6
            else:  # the answer re-encoded from its text: about as long
                assert cur.prompt_len >= prev.prompt_len + 6
            # The previous prompt's whole blocks are in the cache of the only replica.
            assert cur.cached_prompt_tokens >= prev.prompt_len // BLOCK_SIZE * BLOCK_SIZE
        assert all(r.completion_tokens == 5 for r in turns)


def test_a_multi_turn_run_reports_the_cached_share_of_its_continued_turns(cluster, tmp_path, capsys):
    """``bench serve --dataset-name multi-turn`` through the CLI: every continued turn extends the
    previous prompt and answer, so the only replica holds their KV and the run's continued-turn hit
    rate (JSON and table) is at least every such whole block over the continued prompts: >= 0.8."""
    first_len, question_len, output_len, turns = 40, 4, 4, 3
    with routers(cluster) as (address, _):
        report = bench(cluster[1], tmp_path, "--url", address, "--dataset-name", "multi-turn", "--seed", "15",
                       "--num-prompts", "6", "--multi-turn-turns", str(turns), "--multi-turn-input-len",
                       str(first_len), "--multi-turn-question-len", str(question_len), "--multi-turn-output-len",
                       str(output_len), "--max-concurrency", "2")
    assert report["failed"] == 0 and report["completed"] == 6
    assert report["continued_turns"] == 4  # two conversations, two continued turns each
    prompts = [first_len + t * (question_len + output_len) for t in range(turns)]
    # A continued turn finds the previous prompt and answer's whole blocks with KV (the answer's
    # last token has none yet): per conversation, turns 1 and 2.
    cached = [(prev + output_len - 1) // BLOCK_SIZE * BLOCK_SIZE for prev in prompts[:-1]]
    assert all(c >= 0.8 * prev for c, prev in zip(cached, prompts))
    bound = round(sum(cached) / sum(prompts[1:]), 4)
    assert report["continued_turn_hit_rate"] >= max(bound, 0.8), (report["continued_turn_hit_rate"], bound)
    assert report["prefix_hit_rate"] < report["continued_turn_hit_rate"]  # first turns miss
    table = capsys.readouterr().out
    assert "Continued-turn hit rate (4 turns):" in table, table


def test_multi_turn_over_the_responses_api_continues_by_previous_response_id(cluster):
    """``--backend openai-responses``: each later turn sends its new part with the previous
    response's id; it carries the previous turn's context, finds its KV (>= 0.8 of the previous
    turn's input cached), and the client's continued-turn figures equal the router's
    router_continued_turn_tokens_total; the responses are deleted when the client closes."""
    import openai

    from cluster.bench.metrics import summarize
    from cluster.bench.serve import run_requests
    from cluster.bench.serve_setup import make_client
    from router.metrics import get_router_metrics

    _, model_dir, _, namespace = cluster
    convs = multi_turn_dataset(6, 3, 40, 4, 4, VOCAB, seed=16)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    registry = get_router_metrics(namespace, "cache_aware").registry

    def continued_tokens():
        return {s.labels["kind"]: s.value for m in registry.collect() for s in m.samples
                if s.name == "prefixserve:router_continued_turn_tokens_total"}

    async def main(base_url):
        client = make_client("openai-responses", base_url, tokenizer)
        try:
            records, duration = await run_requests(client, convs, max_concurrency=2, progress=False)
            return records, duration, list(client._created)
        finally:
            await client.aclose()

    with routers(cluster, responses=True) as (_, base_url):
        before = continued_tokens()
        records, duration, created = asyncio.run(main(base_url))
        after = continued_tokens()
        with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as api:
            with pytest.raises(openai.NotFoundError):  # deleted by the client's aclose
                api.responses.retrieve(created[0])
    assert len(records) == 6 and all(r.ok for r in records), [r.error for r in records]
    assert len(created) == 6
    by_conv = {}
    for r in sorted(records, key=lambda r: (r.conversation, r.turn)):
        by_conv.setdefault(r.conversation, []).append(r)
    for turns in by_conv.values():
        assert [r.turn for r in turns] == [0, 1, 2]
        for prev, cur in zip(turns, turns[1:]):
            assert cur.prompt_tokens >= prev.prompt_tokens + prev.completion_tokens  # the context came along
            assert cur.cached_prompt_tokens >= 0.8 * prev.prompt_tokens, (prev, cur)
    summary = summarize(records, duration)
    continued = [r for r in records if r.turn > 0]
    assert summary["continued_turns"] == 4
    prompt = after.get("prompt", 0) - before.get("prompt", 0)
    cached = after.get("cached_prompt", 0) - before.get("cached_prompt", 0)
    assert prompt == sum(r.prompt_tokens for r in continued) and cached == sum(r.cached_prompt_tokens
                                                                               for r in continued)
    assert summary["continued_turn_hit_rate"] == round(cached / prompt, 4)


def test_status_lists_the_replica(cluster, capsys):
    with routers(cluster) as (address, _):
        deadline = time.monotonic() + 60
        while True:  # heartbeats (1 s) may still report a request of the tests above as running
            capsys.readouterr()
            assert cli.main(["status", "--url", address]) == 0
            lines = capsys.readouterr().out.strip().splitlines()
            idle = len(lines) == 3 and lines[-1].startswith("1 replica(s), 0 running, 0 waiting")
            if idle or time.monotonic() > deadline:
                break
            time.sleep(1.0)
    assert lines[0].split()[:4] == ["replica", "KV", "use", "running"]
    assert len(lines) == 3 and lines[-1].startswith("1 replica(s), 0 running, 0 waiting")
    row = lines[1].split()
    assert row[1] == "0.0%"  # idle: nothing in use
    assert row[4] == "0" and row[6].endswith("%")  # swapped and hit rate come with ListReplicas too


def test_status_with_metrics_shows_swapped_and_hit_rate(cluster, capsys):
    """After the traffic of the tests above, /metrics has the replica's counters."""
    with routers(cluster) as (address, base_url):
        metrics_url = base_url[: -len("/v1")] + "/metrics"
        deadline = time.monotonic() + 60
        while True:  # the replica publishes its series with its heartbeats
            capsys.readouterr()
            assert cli.main(["status", "--url", address, "--metrics-url", metrics_url]) == 0
            lines = capsys.readouterr().out.strip().splitlines()
            if (len(lines) == 3 and lines[1].split()[6] != "-") or time.monotonic() > deadline:
                break
            time.sleep(1.0)
    assert lines[0].split() == ["replica", "KV", "use", "running", "waiting", "swapped", "cached", "blocks",
                                "hit", "rate", "prompt", "tok/s", "gen", "tok/s", "quantization", "weights"]
    row = lines[1].split()
    assert len(lines) == 3, lines  # one replica: /metrics and ListReplicas name it alike
    assert row[4] == "0"  # nothing swapped
    assert 0.0 < float(row[6].rstrip("%")) <= 100.0  # the shared-prefix runs above hit the cache
    assert row[7:9] == ["-", "-"]  # token rates need two scrapes (--watch)
    assert row[9] == "none"  # model_info's quantization label: this replica runs float weights
    assert row[10].isdigit() and row[11] == "MiB", row  # model_weight_bytes, shown in MiB


def test_status_and_bench_say_what_is_wrong(tmp_path, caplog):
    assert cli.main(["status", "--url", "127.0.0.1:1", "--timeout", "2"]) == 2
    assert "ListReplicas on 127.0.0.1:1 failed: UNAVAILABLE" in caplog.text
    assert cli.main(["bench", "serve", "--backend", "openai", "--url", "127.0.0.1:1"]) == 2
    assert "--url is for --backend grpc" in caplog.text
    assert cli.main(["bench", "serve", "--url", "127.0.0.1:1", "--goodput", "ttft=5"]) == 2
    assert "--goodput takes NAME:MS" in caplog.text


@pytest.mark.parametrize("dataset", ["choice", "json"])
@pytest.mark.parametrize("backend", ["grpc", "openai"])
def test_bench_serve_structured_outputs_validate(cluster, tmp_path, backend, dataset):
    """A random model's constrained answers still validate. A choice ends where
    its grammar does, so every answer stops and is judged (random text would
    not pass); the random model never closes a free JSON string, so json answers
    run to ``length``: counted apart, and any that stopped must validate.

    Last in the module: its jump-forward tokens count as spec-decode drafts,
    which would add a column to the status tables the tests above check."""
    with routers(cluster) as (address, base_url):
        target = ["--url", address] if backend == "grpc" else ["--backend", "openai", "--base-url", base_url]
        report = bench(cluster[1], tmp_path, *target, "--dataset-name", dataset, "--num-prompts", "4",
                       "--max-concurrency", "2", "--seed", "21")
    assert report["failed"] == 0 and report["structured_requests"] == 4, report.get("errors")
    assert report["structured_stop"] + report["structured_length"] == 4
    assert report["structured_valid"] == report["structured_stop"], report.get("structured_invalid_examples")
    if dataset == "choice":
        assert report["structured_stop"] == 4 and report["structured_valid_share"] == 1.0
    else:
        assert report["structured_valid_share"] in (1.0, None)  # None: nothing stopped to judge
    assert report["config"]["structured_output_ratio"] == 1.0 and report["config"]["dataset_name"] == dataset
