"""The ``prefixserve`` command line.

    prefixserve up [--config cluster.yaml] [--replicas N] [--tensor-parallel-size M] [engine flags]   local cluster
    prefixserve generate "prompt" [--chat] [engine flags]   offline, streams text
    prefixserve generate --url HOST:PORT "prompt" [--chat]   via a running cluster (gRPC)
    prefixserve chat [--url HOST:PORT] [--system TEXT]       multi-turn chat on the terminal
    prefixserve bench offline [--num-prompts 64] ...         engine vs HF generate
    prefixserve bench routing [--request-rate R] ...         one workload per routing policy
    prefixserve bench router [--requests N] ...              the router's own cost (echo replicas)
    prefixserve soak [--duration 300] ...                    mixed load with faults of clients; leak check
    prefixserve bench serve [--url HOST:PORT] [--dataset-name D] ...   serving benchmark (as vllm bench serve)
    prefixserve status --url HOST:PORT [--watch [SECONDS]]   table of the live replicas

Engine flags are generated from ``EngineConfig`` and named as vLLM names them
(``--block-size``, ``--max-num-seqs``, ``--max-num-batched-tokens``,
``--enable-chunked-prefill`` / ``--no-enable-chunked-prefill``, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import sys
import typing
from typing import Any, Optional, Sequence

from cluster.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig

logger = logging.getLogger("prefixserve")

_ENGINE_SECTIONS = (EngineConfig, CacheConfig, SchedulerConfig, ParallelConfig)
_SKIP = {"cache", "scheduler", "parallel"}


def add_engine_args(parser: argparse.ArgumentParser, exclude: Sequence[str] = ()) -> None:
    """Adds one flag per engine config field (defaults: None = config default),
    except the fields named in ``exclude`` (their flags mean something else there)."""
    group = parser.add_argument_group("engine")
    for klass in _ENGINE_SECTIONS:
        hints = typing.get_type_hints(klass)
        for f in dataclasses.fields(klass):
            if f.name in _SKIP or f.name in exclude:
                continue
            flag = "--" + f.name.replace("_", "-")
            kind = _base_type(hints[f.name])
            if kind is bool:
                group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None)
            else:
                group.add_argument(flag, dest=f.name, type=kind, default=None, help=f"default: {f.default!r}")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags the user set (others keep the config defaults)."""
    names = {f.name for k in _ENGINE_SECTIONS for f in dataclasses.fields(k)} - _SKIP
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """Flags of the front ends: input limits (from ``Limits``), TLS and API keys."""
    from router.limits import Limits

    limits = parser.add_argument_group("limits (router/limits.py)")
    hints = typing.get_type_hints(Limits)
    for f in dataclasses.fields(Limits):
        limits.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=_base_type(hints[f.name]),
                            default=None, help=f"default: {f.default!r}")
    sec = parser.add_argument_group("security (router/security.py)")
    sec.add_argument("--tls-cert", default=None, help="serve gRPC and HTTP over TLS with this certificate (PEM)")
    sec.add_argument("--tls-key", default=None, help="private key (PEM) of --tls-cert")
    sec.add_argument("--tls-client-ca", default=None, help="require client certificates signed by this CA (mTLS)")
    sec.add_argument("--api-key", action="append", default=None,
                     help="require 'Authorization: Bearer <key>' with this key (repeatable)")
    sec.add_argument("--api-key-file", default=None, help="file of accepted keys, one per line")
    sec.add_argument("--auth-health", action="store_true", help="require a key for health checks too")
    sec.add_argument("--auth-metrics", action="store_true", help="require a key for /metrics too")


def limits_from_args(args: argparse.Namespace, base: Optional[dict] = None) -> Any:
    """The ``Limits`` of ``base`` (the config file's ``router.limits``) with the flags set on top."""
    from router.limits import Limits

    flags = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(Limits)}
    return Limits.from_kwargs(**{**(base or {}), **{k: v for k, v in flags.items() if v is not None}})


def security_from_args(args: argparse.Namespace, router: Any = None) -> Any:
    """The front ends' ``Security`` from the flags, falling back to the config
    file's ``router`` section (``RouterConfig``); None when nothing is set.

    Raises:
        ValueError: Only one of --tls-cert / --tls-key, a client CA without
            TLS, or an unreadable file / empty key file.
    """
    from router.security import Security

    def pick(flag: str, key: Optional[str] = None) -> Any:
        value = getattr(args, flag, None)
        return value if value not in (None, False) else getattr(router, key or flag, None)

    return Security.from_options(
        tls_cert=pick("tls_cert"), tls_key=pick("tls_key"), tls_client_ca=pick("tls_client_ca"),
        api_keys=getattr(args, "api_key", None) or (), api_key_file=pick("api_key_file"),
        auth_health=bool(pick("auth_health")), auth_metrics=bool(pick("auth_metrics")),
    )


def _base_type(hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.url:
        import asyncio

        return asyncio.run(_generate_remote(args))
    from cluster.chat_template import ChatTemplate
    from cluster.types import SamplingParams
    from workers.llm import LLM

    llm = LLM(**engine_kwargs(args))
    prompt = args.prompt
    if args.chat:
        template = ChatTemplate.from_model_dir(llm.model_dir)
        if template is None:
            raise ValueError("this model has no chat template: drop --chat")
        prompt = template.render([{"role": "user", "content": prompt}])
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        stop=tuple(args.stop or ()),
    )
    request = llm.make_request(prompt, params, add_special_tokens=not args.chat)
    llm.engine.add_request(request)
    for out in llm.stream_until_done():
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
        if out.finished:
            sys.stdout.write("\n")
            logger.info(
                "finish_reason=%s prompt_tokens=%d completion_tokens=%d",
                out.finish_reason.value, out.num_prompt_tokens, out.num_output_tokens,
            )
    return 0


async def _generate_remote(args: argparse.Namespace) -> int:
    """``generate --url``: streams the text of one request from a running cluster over gRPC."""
    import grpc

    from router.pb import generation_pb2 as pb
    from router.pb import generation_pb2_grpc as pb_grpc

    sampling = pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                 top_k=args.top_k, stop=list(args.stop or ()))
    if args.sampling_seed is not None:
        sampling.seed = args.sampling_seed
    request = pb.GenerateRequest(sampling=sampling)
    if args.chat:
        request.messages.items.add(role="user", content=args.prompt)
    else:
        request.prompt = args.prompt
    from cluster.chat_client import open_channel

    channel, metadata = open_channel(args)
    async with channel:
        try:
            stub = pb_grpc.GenerationStub(channel)
            async for chunk in stub.Generate(request, timeout=args.timeout, metadata=metadata):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason:
                    sys.stdout.write("\n")
                    logger.info("replica=%s finish_reason=%s prompt_tokens=%d completion_tokens=%d "
                                "cached_prompt_tokens=%d", chunk.replica_id, chunk.finish_reason,
                                chunk.usage.prompt_tokens, chunk.usage.completion_tokens,
                                chunk.usage.cached_prompt_tokens)
        except grpc.aio.AioRpcError as exc:
            logger.error("%s: %s", exc.code().name, exc.details())
            return 4
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from cluster import chat_client

    return chat_client.run_chat(args, engine_kwargs(args))


def _cmd_up(args: argparse.Namespace) -> int:
    import asyncio
    import signal
    import threading

    from cluster.local import LocalCluster

    config = up_config(args)
    stop = threading.Event()

    def on_signal(*_: object) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    cluster = LocalCluster(config, grpc_port=config.router.grpc_port, grpc_host=config.router.host,
                           http_port=config.router.http_port,
                           limits=limits_from_args(args, config.router.limits),
                           security=security_from_args(args, config.router))
    try:
        cluster.start()
        # ray.init installs its own SIGTERM handler (it aborts): take it back.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        rss_mib, count = _tree_rss_mib()
        logger.info("ready: gRPC on %s, OpenAI HTTP on %s, start-up %.1fs, %d processes, RSS %.0f MiB; "
                    "Ctrl-C or SIGTERM stops", cluster.grpc_address, cluster.http_url, cluster.startup_seconds,
                    count, rss_mib)
        if args.prompt:
            asyncio.run(_stream_prompt(cluster, args.prompt, args.max_tokens))
        if not args.exit_after_prompt:
            stop.wait()
    finally:
        cluster.stop()
    return 0


# `up` flags that override a top-level field of the cluster config.
_UP_CLUSTER_FLAGS = ("replicas", "replica_num_cpus", "rank_num_cpus", "redis_url", "namespace",
                     "max_ongoing_requests", "routing_policy")


def up_config(args: argparse.Namespace) -> Any:
    """The ``ClusterConfig`` of ``up``: the ``--config`` file (or the
    defaults), then every flag given on the command line on top of it.

    Raises:
        ValueError: The file or a flag is invalid (names the key).
    """
    from cluster.config import ClusterConfig, EngineConfig

    base = ClusterConfig.from_yaml(args.config) if args.config else ClusterConfig()
    top = {name: getattr(args, name) for name in _UP_CLUSTER_FLAGS if getattr(args, name) is not None}
    router = {}
    if args.grpc_port is not None:
        router["grpc_port"] = args.grpc_port
    if args.grpc_host is not None:
        router["host"] = args.grpc_host
    if args.http_port is not None:
        router["http_port"] = None if args.http_port < 0 else args.http_port
    for name in ("migration_limit", "drain_timeout_s"):
        if getattr(args, name) is not None:
            router[name] = getattr(args, name)
    engine = base.engine
    if engine_kwargs(args):
        engine = EngineConfig.from_kwargs(**{**base.engine.flat(), **engine_kwargs(args)})
    return dataclasses.replace(base, **top, engine=engine, router=dataclasses.replace(base.router, **router))


async def _stream_prompt(cluster, prompt: str, max_tokens: int) -> None:
    from tokenizers import Tokenizer

    from cluster.types import GenerationRequest, SamplingParams
    from workers.model.loader import resolve_model

    model_dir = resolve_model(cluster.config.engine.model)
    if not (model_dir / "tokenizer.json").is_file():
        raise ValueError(f"{model_dir} has no tokenizer.json: --prompt needs one")
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(prompt).ids
    request = GenerationRequest("cli-prompt", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    async for chunk in cluster.generate(request):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        if chunk.finished:
            sys.stdout.write("\n")
            logger.info("replica=%s finish_reason=%s cached_prompt_tokens=%d",
                        chunk.replica_id, chunk.finish_reason.value, chunk.cached_prompt_tokens)


def _tree_rss_mib() -> tuple[float, int]:
    """RSS of this process and all its descendants (Ray, Redis, replicas)."""
    import psutil

    me = psutil.Process()
    procs = [me] + me.children(recursive=True)
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20, len(procs)


def _cmd_bench_routing(args: argparse.Namespace) -> int:
    from cluster import bench_routing

    return bench_routing.run_routing(args, engine_kwargs(args))


def _cmd_soak(args: argparse.Namespace) -> int:
    from cluster import soak

    return soak.run_soak_command(args, engine_kwargs(args))


def _cmd_bench_router(args: argparse.Namespace) -> int:
    from cluster import bench_router

    return bench_router.run_router_bench(args)


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from cluster import bench_serve

    # --seed is the dataset's seed here (as in vllm bench serve), not the engine's.
    return bench_serve.run_serve(args, {k: v for k, v in engine_kwargs(args).items() if k != "seed"})


def _cmd_status(args: argparse.Namespace) -> int:
    from cluster import status

    return status.run_status(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from cluster import bench

    return bench.run_offline(args, engine_kwargs(args))


class _Parser(argparse.ArgumentParser):
    """No abbreviated flags (a typo must not silently pick another flag), and
    unknown flags get the closest known one suggested."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        if message.startswith("unrecognized arguments:"):
            known = [opt for action in self._all_actions() for opt in action.option_strings]
            hints = []
            for arg in message.split(":", 1)[1].split():
                close = difflib.get_close_matches(arg.split("=")[0], known, n=1)
                if close:
                    hints.append(f"{arg}: did you mean {close[0]}?")
            if hints:
                message += "\n" + "\n".join(hints)
        super().error(message)

    def _all_actions(self) -> list[argparse.Action]:
        actions = list(self._actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    actions.extend(sub._all_actions() if isinstance(sub, _Parser) else sub._actions)
        return actions


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="prefixserve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="run the offline engine on one prompt and stream the text")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--url", default=None,
                     help="HOST:PORT of a running cluster's gRPC router (default: run the offline engine)")
    gen.add_argument("--timeout", type=float, default=300.0, help="deadline of a --url request in seconds")
    from cluster.chat_client import add_connection_args

    add_connection_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    chat = sub.add_parser("chat", help="multi-turn chat: offline engine, or a running cluster with --url")
    from cluster import chat_client

    chat_client.add_chat_args(chat)
    add_engine_args(chat)
    chat.set_defaults(func=_cmd_chat)

    up = sub.add_parser("up", help="start a local cluster: Ray on loopback, redis-server, replicas")
    up.add_argument("--config", default=None, metavar="CLUSTER_YAML",
                    help="cluster config file (the RayService's schema); flags override its values")
    # Defaults None: unset flags keep the --config file's value (or the config default).
    up.add_argument("--replicas", type=int, default=None, help="default: 1")
    up.add_argument("--replica-num-cpus", type=float, default=None,
                    help="CPUs reserved per replica (fractional; default 0.5)")
    up.add_argument("--rank-num-cpus", type=float, default=None,
                    help="CPUs reserved per tensor-parallel rank (default 0.5)")
    up.add_argument("--redis-url", default=None, help="use this Redis instead of starting redis-server")
    up.add_argument("--namespace", default=None, help="prefix-directory namespace (default 'default')")
    up.add_argument("--max-ongoing-requests", type=int, default=None, help="default: 256")
    up.add_argument("--routing-policy", default=None,
                    choices=["cache_aware", "least_load", "power_of_two", "round_robin"],
                    help="default: cache_aware")
    up.add_argument("--grpc-port", type=int, default=None,
                    help="port of the gRPC router (0: pick a free one; default 50051)")
    up.add_argument("--grpc-host", default=None, help="interface the gRPC and HTTP routers bind (default 127.0.0.1)")
    up.add_argument("--http-port", type=int, default=None,
                    help="port of the OpenAI-compatible HTTP API (0: pick a free one; -1: none; default 8000)")
    up.add_argument("--migration-limit", type=int, default=None,
                    help="most times a stream moves to another replica when its replica dies (default 3)")
    up.add_argument("--drain-timeout-s", type=float, default=None,
                    help="on SIGTERM, seconds running streams get to finish (default 30)")
    up.add_argument("--prompt", default=None, help="send one prompt through the cluster once it is up")
    up.add_argument("--max-tokens", type=int, default=64, help="for --prompt")
    up.add_argument("--exit-after-prompt", action="store_true", help="stop after --prompt instead of serving")
    add_router_args(up)
    add_engine_args(up)
    up.set_defaults(func=_cmd_up)

    soak_parser = sub.add_parser("soak", help="bounded mixed load (cancels, deadlines, bad requests); checks for leaks")
    from cluster import soak as soak_mod

    soak_mod.add_soak_args(soak_parser)
    add_engine_args(soak_parser)
    soak_parser.set_defaults(func=_cmd_soak)

    bench_parser = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench_parser.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    off = bench_sub.add_parser("offline", help="our engine vs Hugging Face generate, same workload")
    from cluster import bench as bench_mod

    bench_mod.add_offline_args(off)
    add_engine_args(off)
    off.set_defaults(func=_cmd_bench)
    routing = bench_sub.add_parser("routing", help="the same multi-tenant workload once per routing policy")
    from cluster import bench_routing

    bench_routing.add_routing_args(routing)
    add_engine_args(routing)
    routing.set_defaults(func=_cmd_bench_routing)
    router_bench = bench_sub.add_parser("router", help="the router's own cost: decision time, routed req/s")
    from cluster import bench_router

    bench_router.add_router_args(router_bench)
    router_bench.set_defaults(func=_cmd_bench_router)
    serve_bench = bench_sub.add_parser("serve", help="serving benchmark: throughput, TTFT/TPOT/ITL, hit rate")
    from cluster import bench_serve

    bench_serve.add_serve_args(serve_bench)
    add_engine_args(serve_bench, exclude=("seed",))
    serve_bench.set_defaults(func=_cmd_bench_serve)

    status_parser = sub.add_parser("status", help="table of the live replicas (ListReplicas, /metrics)")
    from cluster import status as status_mod

    status_mod.add_status_args(status_parser)
    status_parser.set_defaults(func=_cmd_status)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
        from cluster.redis_server import RedisServerNotFound

        if not isinstance(exc, RedisServerNotFound):
            raise
        logger.error("%s", exc)
        return 3


if __name__ == "__main__":
    sys.exit(main())
