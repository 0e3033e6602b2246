"""``prefixserve chat``: a multi-turn chat on the terminal.

Each line read from stdin is a user turn; the reply streams to stdout and
joins the history, so the next turn sees the whole conversation. With
``--url`` it talks to a running cluster over gRPC (messages rendered by the
router with the model's chat template); without, it runs the offline engine
on this machine. ``/exit`` or end of input stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any, Callable, Iterator

from router.security import API_KEY_ENV

logger = logging.getLogger(__name__)


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    """Flags of a ``--url`` client: TLS (mTLS) and the API key."""
    group = parser.add_argument_group("connection (with --url)")
    group.add_argument("--tls", action="store_true", help="connect with TLS, verified by the system's CAs")
    group.add_argument("--tls-ca", default=None, help="CA bundle (PEM) that verifies the router; implies TLS")
    group.add_argument("--tls-cert", default=None, help="client certificate (PEM) for mTLS; implies TLS")
    group.add_argument("--tls-key", default=None, help="private key of --tls-cert")
    group.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                       help=f"bearer token sent as 'authorization: Bearer ...' (default: ${API_KEY_ENV})")


def open_channel(args: argparse.Namespace) -> tuple[Any, tuple]:
    """The gRPC channel to ``args.url`` and the call metadata (API key).

    Raises:
        ValueError: A TLS file is unreadable, or a cert comes without its key.
    """
    from router.security import bearer_metadata, client_channel

    channel = client_channel(args.url, tls=getattr(args, "tls", False), ca_file=getattr(args, "tls_ca", None),
                             cert_file=getattr(args, "tls_cert", None), key_file=getattr(args, "tls_key", None))
    return channel, bearer_metadata(getattr(args, "api_key", None))


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="HOST:PORT of a running cluster's gRPC router")
    parser.add_argument("--system", default=None, help="system prompt of the conversation")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=300.0, help="deadline of each --url turn in seconds")
    add_connection_args(parser)


def run_chat(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    reply_fn = _remote_replier(args) if args.url else _offline_replier(args, engine_args)
    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    for line in _lines():
        if line in ("/exit", "/quit"):
            break
        history.append({"role": "user", "content": line})
        text = "".join(_echo(reply_fn(history)))
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": text})
    return 0


def _lines() -> Iterator[str]:
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.strip()


def _echo(pieces: Iterator[str]) -> Iterator[str]:
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
        yield piece


def _offline_replier(args: argparse.Namespace, engine_args: dict[str, Any]) -> Callable[[list], Iterator[str]]:
    from cluster.chat_template import ChatTemplate
    from cluster.types import SamplingParams
    from workers.llm import LLM

    llm = LLM(**engine_args)
    template = ChatTemplate.from_model_dir(llm.model_dir)
    if template is None:
        raise ValueError(f"{llm.model_dir} has no chat template: use 'prefixserve generate' instead")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)

    def reply(history: list[dict[str, str]]) -> Iterator[str]:
        request = llm.make_request(template.render(history), params, add_special_tokens=False)
        llm.engine.add_request(request)
        for out in llm.stream_until_done():
            yield out.new_text

    return reply


def _remote_replier(args: argparse.Namespace) -> Callable[[list], Iterator[str]]:
    from router.pb import generation_pb2 as pb

    def reply(history: list[dict[str, str]]) -> Iterator[str]:
        request = pb.GenerateRequest(sampling=pb.SamplingParams(max_tokens=args.max_tokens,
                                                                temperature=args.temperature))
        for message in history:
            request.messages.items.add(role=message["role"], content=message["content"])
        yield from asyncio.run(_collect(args, request))

    return reply


async def _collect(args: argparse.Namespace, request: Any) -> list[str]:
    """One turn over gRPC (collected, then echoed; turns are short)."""
    import grpc

    from router.pb import generation_pb2_grpc as pb_grpc

    pieces = []
    channel, metadata = open_channel(args)
    async with channel:
        try:
            stub = pb_grpc.GenerationStub(channel)
            async for chunk in stub.Generate(request, timeout=args.timeout, metadata=metadata):
                pieces.append(chunk.text)
        except grpc.aio.AioRpcError as exc:
            raise ValueError(f"{exc.code().name}: {exc.details()}") from exc
    return pieces
