"""What ``bench serve`` and ``bench routing`` share around their requests:
the transport for a backend, the warm-up request, the model's vocabulary, a
local cluster on free ports, and writing the JSON and the plot."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any, Optional, Sequence

from cluster.bench.clients import BenchClient, GrpcClient, OpenAIClient
from cluster.bench.clients_responses import ResponsesClient
from cluster.bench.datasets import FIRST_USABLE_ID
from cluster.bench.metrics import RequestRecord, plot

logger = logging.getLogger(__name__)


BACKENDS = ("grpc", "openai", "openai-responses")
# The warm-up prompt repeats an id the datasets never generate, so the blocks it
# leaves in the prefix cache can never match a benchmark prompt.
WARMUP_TOKENS = 8
WARMUP_TOKEN_ID = FIRST_USABLE_ID - 1


def make_client(backend: str, target: str, tokenizer: Any = None, timeout: float = 600.0,
                api_key: Optional[str] = None, tls_ca: Optional[str] = None) -> BenchClient:
    """The transport for ``backend`` (``grpc``: ``host:port``; ``openai``, ``openai-responses``:
    ``http(s)://…/v1``)."""
    if backend == "grpc":
        return GrpcClient(target, timeout, api_key=api_key, tls_ca=tls_ca)
    if backend == "openai":
        return OpenAIClient(target, tokenizer=tokenizer, timeout=timeout, api_key=api_key, tls_ca=tls_ca)
    if backend == "openai-responses":
        return ResponsesClient(target, tokenizer=tokenizer, timeout=timeout, api_key=api_key, tls_ca=tls_ca)
    raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


async def warm_up(client: BenchClient) -> None:
    """One short request (connections, first-call costs); fails fast if the server is not there."""
    async for _ in client.stream([WARMUP_TOKEN_ID] * WARMUP_TOKENS, 2):
        pass


def model_vocab(model: Optional[str]) -> tuple[int, Any]:
    """The model's vocabulary size and its tokenizer (None when it has no tokenizer.json)."""
    from tokenizers import Tokenizer

    from workers.model.loader import resolve_model

    model_dir = resolve_model(model)
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer_file = model_dir / "tokenizer.json"
    return int(config["vocab_size"]), Tokenizer.from_file(str(tokenizer_file)) if tokenizer_file.is_file() else None


def start_local_cluster(args: argparse.Namespace, engine: Any, http: bool, grpc: bool = True,
                        routing_policy: Optional[str] = None, redis_url: Optional[str] = None,
                        namespace: str = "bench") -> Any:
    """Starts a ``LocalCluster`` with free ports for the benchmark."""
    from cluster.launch.local import LocalCluster
    from cluster.shared.config import ClusterConfig, RouterConfig

    transport = getattr(args, "replica_transport", None)
    router = RouterConfig(replica_transport=transport) if transport else RouterConfig()
    params = dict(_routing_param(text) for text in getattr(args, "routing_param", None) or ())
    config = ClusterConfig(replicas=args.replicas, replica_num_cpus=args.replica_num_cpus, redis_url=redis_url,
                           namespace=namespace, routing_policy=routing_policy or args.routing_policy, engine=engine,
                           router=router, routing_policy_params=params)
    logger.info("starting a local cluster: %d replicas, policy %s", config.replicas, config.routing_policy)
    cluster = LocalCluster(config, grpc_port=0 if grpc else None, http_port=0 if http else None)
    try:
        return cluster.start()
    except BaseException:
        cluster.stop()  # what did start (Serve, Redis) must not outlive a failed start
        raise


def write_outputs(json_path: Optional[str], report: dict[str, Any], plot_path: Optional[str],
                  runs: Sequence[tuple[str, Sequence[RequestRecord]]], title: str) -> None:
    """Writes the JSON report and the PNG (each only when its path is set)."""
    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
        logger.info("wrote %s", path)
    if plot_path:
        Path(plot_path).parent.mkdir(parents=True, exist_ok=True)
        plot(plot_path, runs, title)
        logger.info("wrote %s", plot_path)


def _routing_param(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` of ``--routing-param``: the value as JSON (a number), else the text."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--routing-param takes NAME=VALUE (e.g. pack_max_seqs=8), got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value
