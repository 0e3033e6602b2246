"""The ``prefixserve`` command line.

    prefixserve up [--config cluster.yaml] [--replicas N] [--tensor-parallel-size M] [engine flags]   local cluster
    prefixserve generate "prompt" [--chat] [engine flags]   offline, streams text
    prefixserve generate --url HOST:PORT "prompt" [--chat]   via a running cluster (gRPC)
    prefixserve chat [--url HOST:PORT] [--system TEXT]       multi-turn chat on the terminal
    prefixserve bench offline [--num-prompts 64] ...         engine vs HF generate
    prefixserve bench latency [--batch-sizes 1 8 32] ...     decode step and prefill times (--compare llama.cpp)
    prefixserve bench parallel [--n 8 --input-len 512] ...   n samples sharing a prompt vs separate requests
    prefixserve bench moe [--batch-sizes 1 8] ...            MoE decode: routed experts vs a dense expert loop
    prefixserve bench kernels [--m 1 8 32] ...               linear-layer backends on the model's shapes
    prefixserve bench routing [--request-rate R] ...         one workload per routing policy
    prefixserve bench router [--requests N] ...              the router's own cost (echo replicas)
    prefixserve simulate [--replicas 10,100,1000] ...        routing at fleet scale, simulated replicas
    prefixserve bench serve [--url HOST:PORT] [--dataset-name D] ...   serving benchmark (as vllm bench serve)
    prefixserve soak [--duration 300] ...                    mixed load with faults of clients; leak check
    prefixserve status --url HOST:PORT [--watch [SECONDS]]   table of the live replicas
    prefixserve router-drain [--socket PATH] [--timeout S]   drain this pod's router (preStop hook)
    prefixserve redis-acl > users.acl                        Redis ACL users: replicas write, routers read

Engine flags are generated from ``EngineConfig`` and named as vLLM names them
(``--block-size``, ``--max-num-seqs``, ``--max-num-batched-tokens``,
``--enable-chunked-prefill`` / ``--no-enable-chunked-prefill``, ...).

Each command's flags and work live with the command (``cluster/client``,
``cluster/bench``, ``cli/up.py``); this module only builds the parser and
dispatches. Modules are imported when their command runs, so ``--help`` and
light commands stay quick.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from cluster.cli.flags import Parser, add_engine_args, engine_kwargs

logger = logging.getLogger("prefixserve")


@dataclass(frozen=True)
class Command:
    """One subcommand: its words, and where its flags and its work live.

    ``module.add_args(parser)`` adds its own flags; ``module.run(args)`` runs
    it, or ``module.run(args, engine_kwargs)`` when it takes engine flags
    (all of ``EngineConfig``'s, less those in ``exclude``, which mean
    something else there).
    """

    words: tuple[str, ...]
    help: str
    module: str
    add_args: str
    run: str
    engine_flags: bool = True
    exclude: tuple[str, ...] = ()

    def dispatch(self, args: argparse.Namespace) -> int:
        run = getattr(importlib.import_module(self.module), self.run)
        if not self.engine_flags:
            return run(args)
        return run(args, {k: v for k, v in engine_kwargs(args).items() if k not in self.exclude})


COMMANDS = (
    Command(("generate",), "run the offline engine on one prompt and stream the text (or --url: a cluster)",
            "cluster.client.generate", "add_generate_args", "run_generate"),
    Command(("chat",), "multi-turn chat: offline engine, or a running cluster with --url",
            "cluster.client.chat", "add_chat_args", "run_chat"),
    Command(("up",), "start a local cluster: Ray on loopback, redis-server, replicas",
            "cluster.cli.up", "add_up_args", "run_up", engine_flags=False),  # adds its engine flags itself
    Command(("soak",), "bounded mixed load (cancels, deadlines, bad requests); checks for leaks",
            "cluster.bench.soak", "add_soak_args", "run_soak_command"),
    Command(("bench", "offline"), "our engine vs Hugging Face generate, same workload",
            "cluster.bench.offline", "add_offline_args", "run_offline"),
    Command(("bench", "latency"), "step times at fixed batch sizes and lengths (--compare llama.cpp)",
            "cluster.bench.latency", "add_latency_args", "run_latency"),
    Command(("bench", "spec"), "speculative decoding on and off, same model, one run: tokens/s, acceptance",
            "cluster.bench.spec", "add_spec_args", "run_spec"),
    Command(("bench", "moe"), "mixture-of-experts decode: routed experts against a dense loop over every expert",
            "cluster.bench.moe", "add_moe_args", "run_moe"),
    Command(("bench", "lora"), "multi-LoRA decode (a different adapter per request) against the base model",
            "cluster.bench.lora", "add_lora_args", "run_lora"),
    Command(("bench", "parallel"), "parallel sampling (n) against the same samples as separate requests",
            "cluster.bench.parallel", "add_parallel_args", "run_parallel"),
    Command(("bench", "structured"), "structured outputs: mask cost, jump-forward speedup, compile latency",
            "cluster.bench.structured", "add_structured_args", "run_structured"),
    Command(("bench", "kernels"), "every linear-layer backend on the model's shapes: time and batch invariance",
            "cluster.bench.kernels", "add_kernels_args", "run_kernels"),
    Command(("bench", "quant"), "every quantization on one table: perplexity, agreement, weights, speed",
            "cluster.bench.quant", "add_quant_args", "run_quant"),
    Command(("quantize",), "write a 4-bit GPTQ or AWQ checkpoint from a float model",
            "cluster.cli.quantize", "add_quantize_args", "run_quantize", engine_flags=False),
    Command(("train-heads",), "fit Medusa heads for speculative decoding on the model's own answers",
            "cluster.cli.train_heads", "add_train_heads_args", "run_train_heads"),
    Command(("eval", "perplexity"), "perplexity on held-out text (and greedy agreement with the float run)",
            "cluster.bench.evaluate", "add_perplexity_args", "run_perplexity"),
    Command(("bench", "routing"), "the same multi-tenant workload once per routing policy",
            "cluster.bench.routing", "add_routing_args", "run_routing"),
    Command(("bench", "routing-lora"), "LoRA adapter placement on real replicas, once per routing policy",
            "cluster.bench.routing_lora", "add_routing_lora_args", "run_routing_lora"),
    Command(("simulate",), "trace replay of 10-1,000 simulated replicas and 1-100 routers with the real policies",
            "cluster.bench.simulate", "add_simulate_args", "run_simulate", engine_flags=False),
    Command(("bench", "router"), "the router's own cost: decision time, routed req/s",
            "cluster.bench.router", "add_router_args", "run_router_bench", engine_flags=False),
    # --seed is the dataset's seed there (as in vllm bench serve), not the engine's.
    Command(("bench", "serve"), "serving benchmark: throughput, TTFT/TPOT/ITL, hit rate",
            "cluster.bench.serve", "add_serve_args", "run_serve", exclude=("seed",)),
    Command(("router-drain",), "drain this pod's router replica: NOT_SERVING, streams finish (a preStop hook)",
            "cluster.cli.drain", "add_drain_args", "run_drain", engine_flags=False),
    Command(("redis-acl",), "the prefix directory's Redis ACL file: replicas write, routers only read",
            "cluster.cli.redis_acl", "add_redis_acl_args", "run_redis_acl", engine_flags=False),
    Command(("status",), "table of the live replicas (ListReplicas, /metrics)",
            "cluster.client.status", "add_status_args", "run_status", engine_flags=False),
)
GROUPS = {"bench": "benchmarks", "eval": "accuracy of the model as served"}


def _unavailable(name: str, exc: ImportError) -> Any:
    def run(args: argparse.Namespace) -> int:
        package = exc.name.split(".")[0] if exc.name else str(exc)
        raise ValueError(f"prefixserve {name} cannot run here: it needs the {package} package, which "
                         "does not import; install prefixserve with its dependencies (pip install -e .)")

    return run


def build_parser() -> argparse.ArgumentParser:
    """The whole ``prefixserve`` parser (every subcommand and flag)."""
    parser = Parser(prog="prefixserve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    groups: dict[str, Any] = {}
    for command in COMMANDS:
        where = sub
        if len(command.words) == 2:
            group = command.words[0]
            if group not in groups:
                group_parser = sub.add_parser(group, help=GROUPS[group])
                groups[group] = group_parser.add_subparsers(dest=group, required=True, parser_class=Parser)
            where = groups[group]
        cmd_parser = where.add_parser(command.words[-1], help=command.help)
        try:
            add_args = getattr(importlib.import_module(command.module), command.add_args)
        except ImportError as exc:  # a package only this command needs (e.g. redis on a bare GPU machine)
            cmd_parser.set_defaults(func=_unavailable(" ".join(command.words), exc), unavailable=True)
            continue
        add_args(cmd_parser)
        if command.engine_flags:
            add_engine_args(cmd_parser, exclude=command.exclude)
        cmd_parser.set_defaults(func=command.dispatch)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``prefixserve`` console script; returns the exit status
    (2: invalid input, with a message saying what to change; 3: redis-server missing)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "unavailable", False):  # an unavailable command's flags are unknown here
        parser.error("unrecognized arguments: " + " ".join(unknown))
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    except RuntimeError as exc:
        from cluster.launch.redis_server import RedisServerNotFound

        if not isinstance(exc, RedisServerNotFound):
            raise
        logger.error("%s", exc)
        return 3


if __name__ == "__main__":
    sys.exit(main())
