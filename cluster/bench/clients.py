"""The two transports of ``prefixserve bench serve``: gRPC and OpenAI HTTP.

Both stream one request and yield ``Delta``s: the new tokens of each chunk,
then (on the last one) the usage the server reported. The runner
(``cluster/bench/serve.py``) timestamps them; the clients only translate.

    GrpcClient("127.0.0.1:50051")             prefixserve.v1.Generation/Generate
    OpenAIClient("http://127.0.0.1:8000/v1")  POST /completions, stream=true,
                                              stream_options.include_usage

Both send the prompt as token ids and ask for greedy decoding with
``ignore_eos``, so every request generates exactly ``max_tokens`` tokens.
The OpenAI API returns text, not token ids: ``OpenAIClient`` counts one
token per text chunk until the usage arrives, and re-encodes the answer with
the tokenizer it was given (for multi-turn conversations).

A ``question`` (the structured-output datasets) goes as one user chat message
instead (gRPC ``messages``; ``POST /chat/completions``), greedy but without
``ignore_eos``: a constrained answer must be able to end where its grammar
does. ``structured_outputs`` (vLLM's object) rides along as the extra-body
field over HTTP and as ``SamplingParams.structured_outputs`` over gRPC.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Mapping, Optional, Protocol, Sequence


class RequestFailed(Exception):
    """The server answered the request with an error (the message says which)."""


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass
class Delta:
    """What one streamed chunk brought.

    Attributes:
        num_tokens: New output tokens (0 for a usage-only or empty chunk).
        token_ids: Their ids, when the transport carries them.
        text: Their text.
        usage: Set on the last chunk.
        replica_id: The replica serving the request, when the transport says.
        finish_reason: ``stop``, ``length`` or ``abort`` on the chunk that
            ends the output; empty before.
        response_id: The stored response's id (the Responses API client),
            on the chunk that ends it.
    """

    num_tokens: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    usage: Optional[Usage] = None
    replica_id: str = ""
    finish_reason: str = ""
    response_id: str = ""


class BenchClient(Protocol):
    """Streams one request; ``aclose`` releases connections."""

    name: str

    def stream(self, prompt_token_ids: Sequence[int], max_tokens: int, *, question: str = "",
               structured_outputs: Optional[Mapping[str, Any]] = None) -> AsyncIterator[Delta]:
        """Yields the deltas of one greedy request: ``ignore_eos`` on token
        ids, or a chat ``question`` (the ids unused) with an optional constraint."""
        ...

    def answer_ids(self, deltas: Sequence[Delta]) -> list[int]:
        """The answer's token ids (to extend a multi-turn conversation)."""
        ...

    async def aclose(self) -> None:
        ...


class GrpcClient:
    """Talks ``prefixserve.v1.Generation`` on ``url`` (``host:port``)."""

    name = "grpc"

    def __init__(self, url: str, timeout: float = 600.0, api_key: Optional[str] = None,
                 tls_ca: Optional[str] = None) -> None:
        import grpc

        from router.pb import generation_pb2_grpc as pb_grpc

        if "://" in url:
            raise ValueError(f"--url takes host:port for the gRPC backend, got {url!r} (drop the scheme)")
        if tls_ca:  # TLS, trusting this CA (a cluster started with --tls-cert)
            credentials = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
            self._channel = grpc.aio.secure_channel(url, credentials)
        else:
            self._channel = grpc.aio.insecure_channel(url)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    async def stream(self, prompt_token_ids: Sequence[int], max_tokens: int, *, question: str = "",
                     structured_outputs: Optional[Mapping[str, Any]] = None) -> AsyncIterator[Delta]:
        import grpc

        request = grpc_request(prompt_token_ids, max_tokens, question, structured_outputs)
        try:
            async for chunk in self._stub.Generate(request, timeout=self.timeout, metadata=self._metadata):
                usage = None
                if chunk.finish_reason:
                    u = chunk.usage
                    usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)
                yield Delta(len(chunk.token_ids), list(chunk.token_ids), chunk.text, usage, chunk.replica_id,
                            chunk.finish_reason)
        except grpc.aio.AioRpcError as exc:
            raise RequestFailed(f"{exc.code().name}: {exc.details()}") from None

    def answer_ids(self, deltas: Sequence[Delta]) -> list[int]:
        return [t for d in deltas for t in d.token_ids]

    async def aclose(self) -> None:
        await self._channel.close()


def grpc_request(prompt_token_ids: Sequence[int], max_tokens: int, question: str = "",
                 structured_outputs: Optional[Mapping[str, Any]] = None) -> Any:
    """The ``GenerateRequest`` of one bench request (see the module doc).

    The sampling params are built as ``SamplingParams`` and converted by the
    router's own ``sampling_params_to_proto``, so the constraint's proto
    fields are never spelled twice.

    Raises:
        ValueError: ``structured_outputs`` is not a valid constraint.
    """
    from cluster.shared.types import SamplingParams
    from router.convert import sampling_params_to_proto
    from router.pb import generation_pb2 as pb

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=not question,
                            structured_outputs=dict(structured_outputs) if structured_outputs else None)
    sampling = sampling_params_to_proto(params)
    if question:
        messages = pb.ChatMessages(items=[pb.ChatMessage(role="user", content=question)])
        return pb.GenerateRequest(messages=messages, sampling=sampling)
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=list(prompt_token_ids)), sampling=sampling)


class OpenAIClient:
    """Talks the OpenAI completions (or, for a question, chat completions) API under ``base_url`` (``http://host:port/v1``) with aiohttp.

    Args:
        base_url: The API root, ending in ``/v1``.
        model: The ``model`` field to send (None: the first of ``GET /models``).
        tokenizer: ``tokenizers.Tokenizer`` to re-encode answers (multi-turn).
        timeout: Seconds a request may take.
        api_key: Sent as ``Authorization: Bearer``, when the server wants one.
    """

    name = "openai"

    def __init__(self, base_url: str, model: Optional[str] = None, tokenizer: Any = None,
                 timeout: float = 600.0, api_key: Optional[str] = None, tls_ca: Optional[str] = None) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must be an http(s) URL like http://127.0.0.1:8000/v1, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.tokenizer = tokenizer
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.tls_ca = tls_ca  # an https URL's CA (a cluster started with --tls-cert); None: the system's
        self._session: Any = None  # made on first use, inside the running event loop

    def _http(self) -> Any:
        import aiohttp

        if self._session is None:
            # No connection cap: requests in flight are bounded by the runner alone.
            ssl_context: Any = None
            if self.tls_ca:
                import ssl

                ssl_context = ssl.create_default_context(cafile=self.tls_ca)
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout),
                                                  connector=aiohttp.TCPConnector(limit=0, ssl=ssl_context),
                                                  headers=self._headers)
        return self._session

    async def _model(self) -> str:
        if self.model is None:
            async with self._http().get(f"{self.base_url}/models") as response:
                if response.status != 200:
                    raise RequestFailed(f"GET {self.base_url}/models: HTTP {response.status}")
                self.model = (await response.json())["data"][0]["id"]
        return self.model

    async def stream(self, prompt_token_ids: Sequence[int], max_tokens: int, *, question: str = "",
                     structured_outputs: Optional[Mapping[str, Any]] = None) -> AsyncIterator[Delta]:
        body: dict[str, Any] = {"model": await self._model(), "max_tokens": max_tokens, "temperature": 0.0,
                                "stream": True, "stream_options": {"include_usage": True}}
        if question:
            path, body["messages"] = "/chat/completions", [{"role": "user", "content": question}]
        else:
            path, body["prompt"], body["ignore_eos"] = "/completions", list(prompt_token_ids), True
        if structured_outputs:
            body["structured_outputs"] = dict(structured_outputs)
        async with self._http().post(f"{self.base_url}{path}", json=body) as response:
            if response.status != 200:
                raise RequestFailed(f"HTTP {response.status}: {(await response.text())[:500]}")
            async for raw in response.content:  # one server-sent-event line at a time
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    raise RequestFailed(f"stream error: {event['error'].get('message', event['error'])}")
                if event.get("usage"):
                    u = event["usage"]
                    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    yield Delta(0, usage=Usage(u["prompt_tokens"], u["completion_tokens"], cached))
                for choice in event.get("choices") or ():
                    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    reason = choice.get("finish_reason") or ""
                    if text or reason:
                        yield Delta(1 if text else 0, text=text, finish_reason=reason)

    def answer_ids(self, deltas: Sequence[Delta]) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("multi-turn over --backend openai needs the model's tokenizer.json (--model)")
        return self.tokenizer.encode("".join(d.text for d in deltas), add_special_tokens=False).ids

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
