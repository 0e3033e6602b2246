"""``prefixserve bench serve``: the serving benchmark, as ``vllm bench serve``.

    prefixserve bench serve --url 127.0.0.1:50051 --dataset-name shared-prefix
    prefixserve bench serve --backend openai --base-url http://127.0.0.1:8000/v1
    prefixserve bench serve --dataset-name multi-turn --replicas 2   # starts a local cluster
    prefixserve bench serve --backend openai-responses --dataset-name multi-turn   # previous_response_id
    prefixserve bench serve --url 127.0.0.1:50051 --dataset-name json-unique --structured-output-ratio 0.5

It replays a seeded dataset (``cluster/bench/datasets.py``) against a running
cluster, or against a local one it starts (``LocalCluster``) when no URL is
given, and prints throughput, TTFT / TPOT / ITL / E2E percentiles, goodput
and the prefix-cache hit rate (``cluster/bench/metrics.py``); ``--json``
writes them, ``--plot`` draws latency CDFs and output tokens/s over time.

Arrivals: one tick per request, Poisson at ``--request-rate`` (``inf``: no
waiting). At each tick the next ready request is sent, if fewer than
``--max-concurrency`` are in flight. A multi-turn conversation's next turn
becomes ready when the previous one's answer is complete and goes first in
the queue (the user keeps talking), so about ``--max-concurrency``
conversations are active at once. A failed turn ends its conversation.
Over ``--backend openai-responses`` a later turn is sent as its new part only,
continuing the stored previous response by ``previous_response_id``
(``cluster/bench/clients_responses.py``).

Structured-output datasets (``json``, ``json-unique``, ``regex``,
``choice``) send chat questions; each constrained request's whole answer is
kept and judged by the dataset's validator once it finishes with ``stop``
(``structured_*`` figures, ``cluster/bench/metrics.py``).

``run_requests`` is the one code path that sends requests and measures them;
``prefixserve bench routing`` uses it too. The command exits 1 when a
request failed (the figures count the successful ones; ``errors`` in the
JSON says why the others failed).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import random
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from cluster.bench.clients import BenchClient, Delta
from cluster.bench.datasets import (
    STRUCTURED_DATASETS,
    Conversation,
    Turn,
    add_dataset_args,
    make_dataset,
    next_prompt,
)
from cluster.bench.metrics import RequestRecord, format_summary, parse_goodput, summarize
from cluster.bench.serve_baseline import against_baseline, against_rounds, engine_run
from cluster.bench.serve_setup import BACKENDS, make_client, model_vocab, start_local_cluster, warm_up, write_outputs

logger = logging.getLogger(__name__)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``bench serve`` (engine flags are added by the CLI)."""
    parser.add_argument("--backend", default="grpc", choices=BACKENDS,
                        help="grpc, openai (completions; chat for questions) or openai-responses (/v1/responses: a "
                             "later turn continues by previous_response_id)")
    parser.add_argument("--url", default=None, help="HOST:PORT of a running cluster's gRPC router (grpc backend)")
    parser.add_argument("--base-url", default=None,
                        help="OpenAI API root of a running cluster, e.g. http://127.0.0.1:8000/v1 (openai and "
                             "openai-responses backends)")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Poisson arrivals per second (default inf: send as fast as allowed)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                        help="SLOs in milliseconds, e.g. ttft:500 tpot:50 (names: ttft, tpot, e2el)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--api-key", default=None, help="API key of a cluster started with --api-key")
    parser.add_argument("--tls-ca", default=None,
                        help="CA certificate (PEM) to trust: a cluster started with --tls-cert (gRPC over TLS, or an "
                             "https --base-url)")
    parser.add_argument("--json", default=None, help="write the figures (and the run's settings) here")
    parser.add_argument("--plot", default=None, help="draw latency CDFs and output tokens/s over time to this PNG")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.add_argument("--engine-baseline", action="store_true",
                        help="also run the same requests on the engine alone (a child process, before and after "
                             "the cluster's run) and print the cluster's ITL, TTFT and throughput against it "
                             "(random dataset; the engine flags given here)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="with --engine-baseline and a local cluster: run the cluster N times, each freshly "
                             "started, alternated with the engine alone; each round is set against the engine's "
                             "runs around it and the table shows the median round with the range")
    add_dataset_args(parser)
    group = parser.add_argument_group("local cluster (when neither --url nor --base-url is given)")
    group.add_argument("--replicas", type=int, default=2)
    group.add_argument("--replica-num-cpus", type=float, default=0.5)
    group.add_argument("--replica-transport", default=None, choices=["direct", "grpc", "actor"],
                       help="how the router reaches the replicas (default: the cluster config's)")
    group.add_argument("--routing-param", action="append", default=[], metavar="NAME=VALUE",
                       help="a threshold of the routing policy (routing_policy_params), e.g. pack_max_seqs=8")
    group.add_argument("--routing-policy", default="prefix_cost",
                       choices=["cache_aware", "least_load", "power_of_two", "round_robin"])


@dataclass
class _Ready:
    conversation: int
    turn: int
    prompt: list[int]


class _Progress:
    """Counts what is still to be sent (a failed turn drops the rest of its conversation)."""

    def __init__(self, total: int) -> None:
        self.to_send = total
        self.sent = 0
        self.wake = asyncio.Event()


async def run_requests(
    client: BenchClient,
    conversations: Sequence[Conversation],
    request_rate: float = float("inf"),
    max_concurrency: Optional[int] = None,
    seed: int = 0,
    progress: bool = True,
    desc: str = "bench",
) -> tuple[list[RequestRecord], float]:
    """Sends every turn of ``conversations`` through ``client`` and measures each.

    Args:
        client: The transport (``GrpcClient``, ``OpenAIClient``).
        conversations: The dataset.
        request_rate: Poisson arrivals per second; ``inf`` sends at once.
        max_concurrency: Most requests in flight; None for no cap.
        seed: Seed of the arrival times.
        progress: Show a progress bar on stderr.
        desc: The progress bar's label.

    Returns:
        One record per request sent (in completion order) and the run's
        duration in seconds (first send to last completion).

    Raises:
        ValueError: ``request_rate`` or ``max_concurrency`` is not positive.
    """
    from tqdm import tqdm

    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    arrivals = random.Random(seed + 1)
    state = _Progress(sum(c.num_requests for c in conversations))
    ready = collections.deque(_Ready(i, 0, list(c.turns[0].new_token_ids)) for i, c in enumerate(conversations))
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records: list[RequestRecord] = []
    start = time.perf_counter()
    bar = tqdm(total=state.to_send, desc=desc, unit="req", file=sys.stderr, disable=not progress)

    async def one(item: _Ready) -> None:
        conversation = conversations[item.conversation]
        record, deltas = await _measure(client, conversation, item, start)
        records.append(record)
        if slots is not None:
            slots.release()
        bar.update(1)
        remaining_turns = conversation.num_requests - item.turn - 1
        if record.ok and remaining_turns:
            answer = client.answer_ids(deltas)
            nxt = item.turn + 1
            ready.appendleft(_Ready(item.conversation, nxt, next_prompt(item.prompt, answer, conversation.turns[nxt])))
        elif not record.ok:
            state.to_send -= remaining_turns
            bar.total -= remaining_turns
        state.wake.set()

    tasks = []
    next_at = start
    while state.sent < state.to_send:
        if request_rate != float("inf"):
            next_at += arrivals.expovariate(request_rate)
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        if slots is not None:
            await slots.acquire()
        while not ready and state.sent < state.to_send:
            state.wake.clear()
            await state.wake.wait()
        if not ready:
            break
        state.sent += 1
        tasks.append(asyncio.create_task(one(ready.popleft())))
    await asyncio.gather(*tasks)
    bar.close()
    return records, time.perf_counter() - start


async def _measure(client: BenchClient, conversation: Conversation, item: _Ready,
                   start: float) -> tuple[RequestRecord, list[Delta]]:
    turn = conversation.turns[item.turn]
    record = RequestRecord(item.conversation, item.turn, len(item.prompt), turn.output_len,
                           shared_prefix_len=conversation.shared_prefix_len,
                           structured=turn.structured_outputs is not None)
    deltas: list[Delta] = []
    sent = time.perf_counter()
    record.sent_at = sent - start
    last = sent
    usage = None
    try:
        async for delta in client.stream(item.prompt, turn.output_len, **_chat_kwargs(turn)):
            now = time.perf_counter()
            deltas.append(delta)
            record.replica_id = delta.replica_id or record.replica_id
            record.finish_reason = delta.finish_reason or record.finish_reason
            if delta.num_tokens:
                if record.ttft is None:
                    record.ttft = now - sent
                else:
                    record.itl.append(now - last)
                last = now
                record.token_times.append((now - start, delta.num_tokens))
            usage = delta.usage or usage
        record.latency = time.perf_counter() - sent
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - a failed request is a figure, not a crash
        record.error = f"{type(exc).__name__}: {exc}"
        logger.debug("request %d/%d failed: %s", item.conversation, item.turn, record.error)
        return record, deltas
    if usage is None:
        record.error = "the stream ended without usage"
        return record, deltas
    record.prompt_tokens, record.completion_tokens = usage.prompt_tokens, usage.completion_tokens
    record.cached_prompt_tokens = usage.cached_prompt_tokens
    if turn.question:  # the server rendered the chat template: its count is the prompt's length
        record.prompt_len = usage.prompt_tokens
    if turn.validator is not None:
        record.output_text = "".join(d.text for d in deltas)
        if record.finish_reason == "stop":  # a truncated answer is counted apart, not judged
            record.structured_valid = bool(turn.validator(record.output_text))
    counted = sum(n for _, n in record.token_times)
    if record.token_times and counted != usage.completion_tokens:
        # Text chunks (openai) are counted one token each; the usage is exact.
        t, n = record.token_times[-1]
        record.token_times[-1] = (t, max(0, n + usage.completion_tokens - counted))
    return record, deltas


def _chat_kwargs(turn: Turn) -> dict[str, Any]:
    """A chat turn's extra ``stream`` arguments; none for token ids, so any
    ``BenchClient`` that only knows token ids still runs those datasets."""
    if not turn.question:
        return {}
    return {"question": turn.question, "structured_outputs": turn.structured_outputs}


def run_serve(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    """``prefixserve bench serve``: run the benchmark, print the table, write JSON / PNG."""
    slos = parse_goodput(args.goodput)
    if args.backend == "grpc" and args.base_url:
        raise ValueError("--base-url is for the openai backends; the grpc backend takes --url HOST:PORT")
    if args.backend != "grpc" and args.url:
        raise ValueError(f"--url is for --backend grpc; the {args.backend} backend takes --base-url "
                         "http://HOST:PORT/v1")
    if args.backend == "openai-responses" and args.dataset_name in STRUCTURED_DATASETS:
        raise ValueError("--backend openai-responses runs the token datasets (random, shared-prefix, multi-turn); "
                         "structured outputs go over --backend openai or grpc")
    from cluster.shared.config import EngineConfig

    engine = EngineConfig.from_kwargs(**engine_args)
    vocab_size, tokenizer = model_vocab(engine.model)
    conversations = make_dataset(args, vocab_size)
    target = args.url if args.backend == "grpc" else args.base_url
    rounds = args.rounds
    _check_rounds(args, rounds, target)
    baselines = []
    if args.engine_baseline:
        if args.dataset_name != "random":
            raise ValueError("--engine-baseline runs the random dataset's prompts; drop it or use --dataset-name random")
        baselines.append(engine_run(engine_args, conversations, args.max_concurrency))
    runs: list[tuple[dict[str, Any], list[RequestRecord]]] = []
    url = target
    for number in range(rounds):
        if rounds > 1:
            logger.info("round %d of %d: the cluster, then the engine alone", number + 1, rounds)
        cluster = None if target else start_local_cluster(args, engine, http=args.backend != "grpc")
        try:
            url = target or (cluster.grpc_address if args.backend == "grpc" else cluster.http_url)
            runs.append(asyncio.run(_bench(args, url, tokenizer, conversations, slos, cluster)))
        finally:
            if cluster is not None:
                cluster.stop()
        if args.engine_baseline:  # again after: the machine's speed drifts, the mean brackets the cluster's run
            baselines.append(engine_run(engine_args, conversations, args.max_concurrency))
    summary, records = runs[0] if rounds == 1 else _pooled(runs, slos, args.dataset_name in STRUCTURED_DATASETS)
    if args.engine_baseline:
        summary["engine_baseline"] = (against_baseline(summary, baselines) if rounds == 1
                                      else against_rounds([s for s, _ in runs], baselines))
    summary["config"] = run_config(args, url, engine, local=cluster is not None)
    print("\n".join(format_summary(f"bench serve: {args.dataset_name} over {args.backend}", summary)))
    write_outputs(args.json, summary, args.plot, [(args.dataset_name, records)],
                  f"prefixserve bench serve: {args.dataset_name}, {len(records)} requests over {args.backend}")
    return 0 if summary["failed"] == 0 else 1


def _check_rounds(args: argparse.Namespace, rounds: int, target: Optional[str]) -> None:
    """``--rounds`` alternates a local cluster with the engine alone."""
    if rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {rounds}")
    if rounds > 1 and (target or not args.engine_baseline):
        raise ValueError("--rounds N alternates N runs of a local cluster with the engine alone: add "
                         "--engine-baseline and drop --url / --base-url")


def _pooled(runs: Sequence[tuple[dict[str, Any], list[RequestRecord]]], slos: dict[str, float],
            structured: bool) -> tuple[dict[str, Any], list[RequestRecord]]:
    """The rounds' requests as one run (percentiles over all of them, throughput over their summed
    durations); the replicas' TTFT split is the rounds' request-weighted mean."""
    from cluster.bench import ttft_split

    records = [record for _, round_records in runs for record in round_records]
    summary = summarize(records, sum(s["duration_s"] for s, _ in runs), slos, structured=structured)
    splits = [s["ttft_split"] for s, _ in runs if s.get("ttft_split")]
    if splits:
        summary["ttft_split"] = ttft_split.merge(splits)
    summary["kv_transfers"] = runs[-1][0].get("kv_transfers")
    summary["rounds"] = [{k: s[k] for k in ("ttft_ms", "itl_ms", "output_throughput")} for s, _ in runs]
    return summary, records


async def _bench(args: argparse.Namespace, target: str, tokenizer: Any, conversations: list[Conversation],
                 slos: dict[str, float], cluster: Any = None) -> tuple[dict[str, Any], list[RequestRecord]]:
    """The run; with a local ``cluster``, its replicas' side of the TTFT too (``ttft_split``)."""
    from cluster.bench import ttft_split
    from cluster.bench.routing_transfers import transfer_figures
    from cluster.shared.directory import Directory

    client = make_client(args.backend, target, tokenizer, args.timeout, args.api_key, args.tls_ca)
    directories = [] if cluster is None else [Directory.from_url(cluster.redis_url, model.namespace)
                                              for model in cluster.config.models_by_name().values()]
    try:
        await warm_up(client)
        before = await ttft_split.settled(directories) if directories else None
        logger.info("sending %d requests (%s) to %s", sum(c.num_requests for c in conversations),
                    args.dataset_name, target)
        records, duration = await run_requests(client, conversations, args.request_rate, args.max_concurrency,
                                               args.seed, progress=not args.disable_tqdm, desc=args.dataset_name)
        summary = summarize(records, duration, slos, structured=args.dataset_name in STRUCTURED_DATASETS)
        if before is not None:  # the warm-up counted (settled above), then the run's requests
            after = await ttft_split.after_run(directories, before, summary["completed"])
            summary["ttft_split"] = ttft_split.split(before, after, summary["ttft_ms"]["mean"])
            # The replicas' KV fetches (issue 33), since they started: the warm-up fetches nothing.
            summary["kv_transfers"] = transfer_figures(await ttft_split.texts(directories))
    finally:
        await client.aclose()
        for directory in directories:
            await directory.aclose()
    return summary, records


def run_config(args: argparse.Namespace, target: Optional[str], engine: Any, local: bool) -> dict[str, Any]:
    """The settings that produced a run (for the JSON)."""
    keys = ["backend", "dataset_name", "num_prompts", "seed", "request_rate", "max_concurrency", "goodput"]
    # Only the chosen dataset's own flags.
    own = {"random": "random_", "shared-prefix": "gsp_", "multi-turn": "multi_turn_",
           **dict.fromkeys(STRUCTURED_DATASETS, "structured_output_")}[args.dataset_name]
    keys += sorted(k for k in vars(args) if k.startswith(own))
    out = {k: getattr(args, k, None) for k in keys}
    out["request_rate"] = str(out["request_rate"]) if out["request_rate"] == float("inf") else out["request_rate"]
    out["target"] = target
    if local:
        out["local_cluster"] = {"replicas": args.replicas, "routing_policy": getattr(args, "routing_policy", None),
                                "num_kv_blocks": engine.cache.num_kv_blocks, "model": engine.model or "default"}
    return out


