"""``prefixserve generate``: one prompt, its text streamed to stdout.

With ``--url`` it goes to a running cluster's gRPC router; without, to the
offline engine on this machine. ``--chat`` wraps the prompt as a user message
(rendered with the model's chat template: by the router, or here).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, AsyncIterator, Iterator

from cluster.client.connection import add_connection_args, open_channel

logger = logging.getLogger(__name__)


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    """The prompt, sampling and ``--url`` flags of ``generate`` (engine flags are the CLI's)."""
    parser.add_argument("prompt")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--stop", action="append", help="stop string (repeatable)")
    parser.add_argument("--url", default=None,
                        help="HOST:PORT of a running cluster's gRPC router (default: run the offline engine)")
    parser.add_argument("--timeout", type=float, default=300.0, help="deadline of a --url request in seconds")
    add_connection_args(parser)


def run_generate(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    """Runs ``generate``; returns the exit status (4: the cluster refused the request)."""
    if args.url:
        import asyncio

        return asyncio.run(_generate_remote(args))
    return _generate_offline(args, engine_args)


def stream_offline(llm: Any, prompt: Any, params: Any, add_special_tokens: bool = True) -> Iterator[Any]:
    """Runs one request on an offline ``workers.LLM`` and yields its outputs (text deltas)."""
    llm.engine.add_request(llm.make_request(prompt, params, add_special_tokens=add_special_tokens))
    yield from llm.stream_until_done()


async def stream_remote(args: argparse.Namespace, request: Any) -> AsyncIterator[Any]:
    """Streams the ``GenerateResponse`` chunks of ``request`` from ``args.url``.

    Raises:
        grpc.aio.AioRpcError: The router refused or failed the request.
    """
    from router.pb import generation_pb2_grpc as pb_grpc

    channel, metadata = open_channel(args)
    async with channel:
        stub = pb_grpc.GenerationStub(channel)
        async for chunk in stub.Generate(request, timeout=args.timeout, metadata=metadata):
            yield chunk


def _generate_offline(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    from cluster.shared.chat_template import ChatTemplate
    from cluster.shared.types import SamplingParams
    from workers.builder import freeze_heap
    from workers.llm import LLM

    llm = LLM(**engine_args)
    freeze_heap()  # one engine for this process's life
    prompt = args.prompt
    if args.chat:
        template = ChatTemplate.from_model_dir(llm.model_dir)
        if template is None:
            raise ValueError("this model has no chat template: drop --chat")
        prompt = template.render([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed, stop=tuple(args.stop or ()))
    for out in stream_offline(llm, prompt, params, add_special_tokens=not args.chat):
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
        if out.finished:
            sys.stdout.write("\n")
            logger.info("finish_reason=%s prompt_tokens=%d completion_tokens=%d",
                        out.finish_reason.value, out.num_prompt_tokens, out.num_output_tokens)
    return 0


async def _generate_remote(args: argparse.Namespace) -> int:
    import grpc

    from router.pb import generation_pb2 as pb

    sampling = pb.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                 top_k=args.top_k, stop=list(args.stop or ()))
    if args.sampling_seed is not None:
        sampling.seed = args.sampling_seed
    request = pb.GenerateRequest(sampling=sampling)
    if args.chat:
        request.messages.items.add(role="user", content=args.prompt)
    else:
        request.prompt = args.prompt
    try:
        async for chunk in stream_remote(args, request):
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
