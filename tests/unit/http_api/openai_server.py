"""The OpenAI HTTP API's test server (``router.openai``): a fake backend that
implements the ``Backend`` protocol (one word per requested token, usage
counters derived from the request, finalization recorded), the real
``RouterTokenizer`` over the tiny test tokenizer with a small chat template,
and ``serve_openai`` on a free loopback port in an event loop on its own
thread (the fixtures: ``tests/unit/http_api/conftest.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, AsyncIterator, Iterator, Optional


from cluster.shared.types import FinishReason, GenerationRequest, StreamChunk, TokenLogprob
from router.backend import ModelInfo
from router.errors import NoReplicaError
from router.openai import serve_openai
from router.tokenizer import RouterTokenizer

MODEL = "tiny-llama"
MAX_MODEL_LEN = 256
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def cached_tokens(prompt_len: int) -> int:
    """What the fake reports as a prefix-cache hit: whole 4-token blocks, leaving one token."""
    return ((prompt_len - 1) // 4) * 4


class FakeBackend:
    """Streams ``max_tokens`` chunks " w0", " w1", ... (or the pieces of ``script``, the
    last ending with ``script_finish``) and records every request and finalization."""

    def __init__(self, tokenizer: RouterTokenizer) -> None:
        self.tokenizer = tokenizer
        self.model = ModelInfo(MODEL, MAX_MODEL_LEN)
        self.requests: list[GenerationRequest] = []
        self.finalized: list[str] = []
        self.finalized_event = threading.Event()
        self.fail: Optional[Exception] = None
        self.delay = 0.0
        self.fail_after: Optional[int] = None
        self.script: Optional[list[str]] = None
        self.script_finish = FinishReason.STOP

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        self.requests.append(request)
        try:
            if self.fail is not None:
                raise self.fail
            pieces = self.script or [f" w{i}" for i in range(request.sampling_params.max_tokens)]
            finish = self.script_finish if self.script else FinishReason.LENGTH
            n = len(pieces)
            prompt_len = len(request.prompt_token_ids)
            choices = request.sampling_params.num_choices
            prompt_lps = None
            if request.sampling_params.prompt_logprobs is not None:
                prompt_lps = [None] + [TokenLogprob(t, -1.0, ((t, -1.0),)) for t in request.prompt_token_ids[1:]]
            for i in range(n):
                if self.delay:
                    await asyncio.sleep(self.delay)
                if i == self.fail_after:
                    raise NoReplicaError("the replica died")
                for c in range(choices):  # choice c's tokens are 100 + i + 10 * c, logprob -0.5 - c
                    logprobs = None
                    if request.sampling_params.logprobs is not None:
                        logprobs = [TokenLogprob(100 + i + 10 * c, -0.5 - c, ((100 + i, -0.5), (7, -1.5)))]
                    yield StreamChunk(
                        request_id=request.request_id,
                        token_ids=[100 + i + 10 * c],
                        text=pieces[i] if not c else f"{pieces[i]}/{c}",
                        finish_reason=finish if i == n - 1 else None,
                        logprobs=logprobs,
                        prompt_tokens=prompt_len,
                        completion_tokens=i + 1,
                        cached_prompt_tokens=cached_tokens(prompt_len),
                        replica_id="replica-0",
                        prompt_logprobs=prompt_lps if i == 0 and c == 0 else None,
                        index=c,
                        more_choices=not (i == n - 1 and c == choices - 1),
                    )
        finally:
            self.finalized.append(request.request_id)
            self.finalized_event.set()


def _error(exc_info) -> dict:
    body = exc_info.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@contextlib.contextmanager
def serving(backend: Any, security: Any = None) -> Iterator[Any]:
    """``serve_openai(backend)`` on a free loopback port, in an event loop on
    its own thread; yields the server's handle (``handle.url``)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    handle = asyncio.run_coroutine_threadsafe(serve_openai(backend, port=0, security=security), loop).result(15)
    try:
        yield handle
    finally:
        asyncio.run_coroutine_threadsafe(handle.stop(), loop).result(15)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
