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
import sys
from typing import Any, Callable, Iterator

from cluster.client.connection import add_connection_args
from cluster.client.generate import stream_offline, stream_remote

logger = logging.getLogger(__name__)


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
    from cluster.shared.chat_template import ChatTemplate
    from cluster.shared.types import SamplingParams
    from workers.builder import freeze_heap
    from workers.llm import LLM

    llm = LLM(**engine_args)
    freeze_heap()  # one engine for this process's life
    template = ChatTemplate.from_model_dir(llm.model_dir)
    if template is None:
        raise ValueError(f"{llm.model_dir} has no chat template: use 'prefixserve generate' instead")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)

    def reply(history: list[dict[str, str]]) -> Iterator[str]:
        for out in stream_offline(llm, template.render(history), params, add_special_tokens=False):
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

    try:
        return [chunk.text async for chunk in stream_remote(args, request)]
    except grpc.aio.AioRpcError as exc:
        raise ValueError(f"{exc.code().name}: {exc.details()}") from exc
