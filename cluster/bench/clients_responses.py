"""``bench serve --backend openai-responses``: the OpenAI Responses API
(``POST /v1/responses``, ``stream: true``), where a conversation's later turn
continues the stored previous one by ``previous_response_id`` instead of
resending it.

    turn 0   input = text of the prompt ids                      -> resp_a
    turn 1   previous_response_id = resp_a, input = text of the
             turn's new ids only (the runner's prompt minus
             turn 0's prompt and answer)                         -> resp_b
    ...

The runner (``cluster/bench/serve.py``) still builds every turn's prompt as
token ids (previous prompt + answer + new question); this client recognises
a prompt that extends one of its own answered responses and sends only the
new part, so the router renders the stored conversation with the chat
template (``router/openai/responses_input.py``) and prefix-aware routing finds
its KV. The usage's ``input_tokens_details.cached_tokens`` is the figure
``bench serve`` reports as the continued-turn hit rate, the client's side of
the routers' ``router_continued_turn_cached_ratio``.

Prompts go as text (the ids decoded with the model's tokenizer), greedy, at
most ``max_output_tokens``; the Responses API has no ``ignore_eos``, so an
answer may end early at EOS (the usage counts what came). Every response it
created is deleted when the client closes, after the measured run, so a
benchmark leaves no state in the cluster's Redis.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Mapping, Optional, Sequence

from cluster.bench.clients import Delta, OpenAIClient, RequestFailed, Usage

logger = logging.getLogger(__name__)

# An input that decodes to no text (the warm-up's special tokens) goes as this.
EMPTY_INPUT = "Hello."
DELETE_CONCURRENCY = 8


class ResponsesClient(OpenAIClient):
    """Talks ``POST /v1/responses`` under ``base_url`` (``http://host:port/v1``); the
    arguments are :class:`OpenAIClient`'s, the tokenizer required."""

    name = "openai-responses"

    def __init__(self, base_url: str, model: Optional[str] = None, tokenizer: Any = None,
                 timeout: float = 600.0, api_key: Optional[str] = None, tls_ca: Optional[str] = None) -> None:
        if tokenizer is None:
            raise ValueError("--backend openai-responses sends prompts as text: it needs the model's tokenizer.json "
                             "(--model)")
        super().__init__(base_url, model, tokenizer, timeout, api_key, tls_ca)
        self._asked: dict[str, list[int]] = {}  # response id -> its prompt ids, until its answer is read
        self._answered: dict[tuple[int, ...], str] = {}  # prompt + answer ids -> response id
        self._created: list[str] = []

    def _split(self, prompt_token_ids: Sequence[int]) -> tuple[Optional[str], list[int]]:
        """The answered response this prompt extends (taken: a turn continues once) and the new ids."""
        for key, response_id in self._answered.items():
            if len(key) <= len(prompt_token_ids) and tuple(prompt_token_ids[:len(key)]) == key:
                del self._answered[key]
                return response_id, list(prompt_token_ids[len(key):])
        return None, list(prompt_token_ids)

    async def stream(self, prompt_token_ids: Sequence[int], max_tokens: int, *, question: str = "",
                     structured_outputs: Optional[Mapping[str, Any]] = None) -> AsyncIterator[Delta]:
        if structured_outputs:
            raise ValueError("--backend openai-responses runs the token datasets (random, shared-prefix, "
                             "multi-turn), not structured outputs: use --backend openai or grpc")
        previous, new_ids = self._split(prompt_token_ids)
        text = question or self.tokenizer.decode(new_ids) or EMPTY_INPUT
        body: dict[str, Any] = {"model": await self._model(), "input": text, "max_output_tokens": max_tokens,
                                "temperature": 0.0, "stream": True}
        if previous is not None:
            body["previous_response_id"] = previous
        async with self._http().post(f"{self.base_url}/responses", json=body) as response:
            if response.status != 200:
                raise RequestFailed(f"HTTP {response.status}: {(await response.text())[:500]}")
            async for raw in response.content:  # one server-sent-event line at a time
                line = raw.decode().strip()
                if line.startswith("data: "):
                    delta = self._delta(json.loads(line[len("data: "):]), prompt_token_ids)
                    if delta is not None:
                        yield delta

    def _delta(self, event: dict, prompt_token_ids: Sequence[int]) -> Optional[Delta]:
        """The ``Delta`` of one stream event (None for the events that bring nothing to count)."""
        kind = event.get("type", "")
        if kind == "response.output_text.delta":
            return Delta(1, text=event["delta"])
        if kind == "response.reasoning_text.delta":  # output tokens too, not part of the answer's text
            return Delta(1)
        if kind in ("response.completed", "response.incomplete"):
            done = event["response"]
            u = done.get("usage") or {}
            cached = (u.get("input_tokens_details") or {}).get("cached_tokens") or 0
            self._asked[done["id"]] = list(prompt_token_ids)
            self._created.append(done["id"])
            return Delta(0, usage=Usage(u.get("input_tokens", 0), u.get("output_tokens", 0), cached),
                         finish_reason="stop" if kind == "response.completed" else "length",
                         response_id=done["id"])
        if kind in ("error", "response.failed"):
            error = event.get("error") or (event.get("response") or {}).get("error") or event
            raise RequestFailed(f"stream error: {error.get('message', error)}")
        return None

    def answer_ids(self, deltas: Sequence[Delta]) -> list[int]:
        """The answer re-encoded; remembers its response as the one the next turn continues."""
        ids = super().answer_ids(deltas)
        response_id = next((d.response_id for d in reversed(deltas) if d.response_id), None)
        if response_id in self._asked:
            self._answered[tuple(self._asked.pop(response_id) + ids)] = response_id
        return ids

    async def aclose(self) -> None:
        """Deletes every response this client created, then closes its connections."""
        if self._created and self._session is not None:
            limit = asyncio.Semaphore(DELETE_CONCURRENCY)

            async def delete(response_id: str) -> bool:
                async with limit:
                    try:
                        async with self._session.delete(f"{self.base_url}/responses/{response_id}") as response:
                            return response.status in (200, 404)
                    except Exception:  # noqa: BLE001 - best effort: the records expire with their TTL anyway
                        return False

            results = await asyncio.gather(*(delete(r) for r in self._created))
            if not all(results):
                logger.warning("could not delete %d of %d stored responses (they expire with the store's TTL)",
                               results.count(False), len(results))
            self._created.clear()
        await super().aclose()
