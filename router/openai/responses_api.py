"""``/v1/responses``: OpenAI's Responses API over the chat path
(``responses_input.py`` converts a request), with stored responses shared by
every router (``response_store.py``).

    POST   /v1/responses                       create (``stream``: server-sent events)
    GET    /v1/responses/{id}                  retrieve a stored response
    DELETE /v1/responses/{id}                  delete it
    GET    /v1/responses/{id}/input_items      the items of its input (``order`` asc / desc)
    POST   /v1/responses/{id}/cancel           cancel a background one (responses_background.py)

A stream sends OpenAI's events, each with ``sequence_number``::

    response.created, response.in_progress
    per output item: response.output_item.added
        message:        response.content_part.added, response.output_text.delta ...,
                        response.output_text.done, response.content_part.done
        function_call:  response.function_call_arguments.delta, ...arguments.done
                        (a call is sent whole when the tool-call parser closes it)
    response.output_item.done, then response.completed (or response.incomplete at
    max_output_tokens), or an ``error`` event

With a reasoning parser, a ``reasoning`` item (``response.reasoning_text.delta``
/ ``.done``; ``responses_reasoning.py``) comes first, and only the content
after the think block is read for calls and kept in the stored conversation.

Stored (``store``, default true): the response, its input items and the
conversation so far (without ``instructions``, which a continuation does not
inherit, as OpenAI documents), under the caller's tenant.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any, AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cluster.shared.types import StreamChunk
from router.metrics import continued_turn
from router.openai import responses_input as conv
from router.openai.bodies import finish_reason
from router.openai.protocol import APIError, backend_error, error_response, internal_error, parse_request
from router.openai.response_store import StoreUnavailable
from router.openai.responses_background import BackgroundRuns
from router.openai.responses import EventStream, close_stream
from router.openai.responses_reasoning import ReasoningEvents, reasoning_item
from router.reasoning import split_pieces
from router.tools import assemble, make_parser, parse_tool_output

logger = logging.getLogger(__name__)


def _unavailable(exc: StoreUnavailable) -> APIError:
    return APIError(503, str(exc), type_="service_unavailable", code="store_unavailable")


class _Outcome:
    """What a generation produced: its text, its calls, its counts."""

    def __init__(self) -> None:
        self.text = ""
        self.reasoning: Optional[str] = None  # the think block, with a reasoning parser
        self.reasoning_id = conv.new_id("rs")
        self.calls: list[dict] = []  # function_call output items
        self.last: Optional[StreamChunk] = None
        self.num_reasoning_tokens = 0

    def usage(self) -> dict:
        last = self.last
        prompt, cached, out = (last.prompt_tokens, last.cached_prompt_tokens, last.completion_tokens) if last \
            else (0, 0, 0)
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": out, "output_tokens_details": {"reasoning_tokens": self.num_reasoning_tokens},
                "total_tokens": prompt + out}


def _call_item(call: Any) -> dict:
    return {"type": "function_call", "id": conv.new_id("fc"), "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": "completed"}


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    """The message output item: its text once completed, no content while in progress."""
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" \
        else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


class ResponsesAPI:
    """The routes' handlers, over an ``OpenAIServer`` (its backends, limits and
    security) and a response store: ``store``, else the backend's
    ``response_store`` attribute, read at each request (None: nothing can be stored)."""

    def __init__(self, server: Any, store: Any = None, backend: Any = None) -> None:
        self.server = server
        self._store = store
        self._backend = backend
        self.background = BackgroundRuns(self)

    @property
    def store(self) -> Any:
        return self._store if self._store is not None else getattr(self._backend, "response_store", None)

    # ------------------------------------------------------------ create
    async def create(self, request: Request) -> Response:
        admission = None
        try:
            tenant, admission = self.server._admit(request)
            limits = tenant.limits_over(self.server.limits) if tenant is not None else self.server.limits
            body = conv.check_create(json.loads(await self.server._read_body(request) or b"null"))
            owner = tenant.name if tenant is not None else "default"
            store = body.get("store", True)
            history: list[dict] = []
            previous = body.get("previous_response_id")
            if (store or previous) and self.store is None:
                raise APIError(400, "this server has no response store: send store: false without "
                                    "previous_response_id", "store")
            if previous:
                record = await self.store.get(owner, previous)
                if record is None:
                    raise conv.not_found(previous)
                history = record["conversation"]
            items = conv.input_items(body["input"])
            messages = conv.chat_messages(items)
            chat = conv.chat_body(body, history, messages)
            await self.server.backends.refresh_adapters()
            backend = self.server._pick(chat)
            parsed = parse_request(chat, True, backend.tokenizer, backend.model, limits)
            if tenant is not None:
                parsed = dataclasses.replace(parsed, request=tenant.apply(parsed.request))
        except json.JSONDecodeError as exc:
            if admission is not None:
                admission.release()
            return error_response(conv.bad_request(f"the request body is not valid JSON ({exc})"))
        except (APIError, StoreUnavailable, PermissionError, ValueError, RuntimeError, LookupError) as err:
            if admission is not None:
                admission.release()
            return error_response(conv.responses_names(self._api_error(err)))
        stream = self.server._open(backend, parsed)
        if previous and getattr(backend, "metrics", None) is not None:  # the cached share of continued turns
            stream = continued_turn(stream, backend.metrics)
        if admission is not None:
            stream = admission.meter(stream)
        response = self._response(body, parsed.echo_model, conv.new_id("resp"), "in_progress", [], None)
        context = (owner, body, items, history + messages, store)
        if body.get("background"):
            try:
                return JSONResponse(await self.background.start(parsed, stream, response, context))
            except (StoreUnavailable, ValueError) as err:
                return error_response(self._api_error(err))
        if body.get("stream"):
            return EventStream(self._events(parsed, stream, response, context),
                               headers={"Cache-Control": "no-cache"})
        try:
            outcome = await self._collect(parsed, stream)
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            err = backend_error(exc)
            if err is None:
                logger.error("response %s failed", response["id"], exc_info=exc)
                err = internal_error(parsed.request.request_id)
            return error_response(err)
        finally:
            await close_stream(stream)
        final = self._finish(response, outcome)
        try:
            await self._save(context, final)
        except (StoreUnavailable, ValueError) as err:
            return error_response(self._api_error(err))
        return JSONResponse(final)

    @staticmethod
    def _api_error(err: BaseException) -> APIError:
        if isinstance(err, APIError):
            return err
        if isinstance(err, StoreUnavailable):
            return _unavailable(err)
        if isinstance(err, PermissionError):
            return APIError(401, str(err), code="invalid_api_key")
        mapped = backend_error(err)
        return mapped if mapped is not None else APIError(400, str(err))

    def _response(self, body: dict, model: str, response_id: str, status: str, output: list,
                  usage: Optional[dict]) -> dict:
        text_format = (body.get("text") or {}).get("format") or {"type": "text"}
        return {
            "id": response_id, "object": "response", "created_at": int(time.time()), "status": status,
            "model": model, "output": output, "usage": usage, "error": None, "incomplete_details": None,
            "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
            "previous_response_id": body.get("previous_response_id"), "store": body.get("store", True),
            "max_output_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature", 1.0),
            "top_p": body.get("top_p", 1.0), "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True), "text": {"format": text_format},
            "truncation": "disabled", "user": body.get("user"), "background": bool(body.get("background")),
            "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None},
        }

    async def _collect(self, parsed: Any, stream: AsyncIterator[StreamChunk]) -> _Outcome:
        outcome = _Outcome()
        pieces = []
        async for chunk in stream:
            pieces.append((chunk.text, len(chunk.token_ids)))
            outcome.last = chunk
            if chunk.finished:
                break
        outcome.reasoning, outcome.text, outcome.num_reasoning_tokens = split_pieces(parsed.reasoning, pieces)
        tool_output = parse_tool_output(parsed.tools, outcome.text)
        if tool_output is not None:
            outcome.text = tool_output.content or ""
            outcome.calls = [_call_item(call) for call in tool_output.tool_calls]
        return outcome

    def _finish(self, response: dict, outcome: _Outcome, message_id: Optional[str] = None) -> dict:
        output = [reasoning_item(outcome.reasoning_id, outcome.reasoning)] if outcome.reasoning else []
        if outcome.text or not outcome.calls:
            output.append(_message_item(message_id or conv.new_id("msg"), outcome.text))
        output.extend(outcome.calls)
        final = {**response, "output": output, "usage": outcome.usage(), "status": "completed"}
        if outcome.last is not None and finish_reason(outcome.last) == "length":
            final.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
        return final

    async def _save(self, context: tuple, final: dict) -> None:
        owner, _, items, messages, store = context
        if not store:
            return
        reply: dict[str, Any] = {"role": "assistant", "content": None}
        for item in final["output"]:
            if item["type"] == "message":
                reply["content"] = "".join(part["text"] for part in item["content"])
            elif item["type"] == "function_call":
                reply.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                    "name": item["name"], "arguments": item["arguments"]}})
        if reply["content"] is None and "tool_calls" not in reply:
            reply["content"] = ""
        await self.store.put(owner, final["id"], {"response": final, "input_items": items,
                                                  "conversation": messages + [reply]})

    # ------------------------------------------------------------ stream
    async def _events(self, parsed: Any, stream: AsyncIterator[StreamChunk], response: dict,
                      context: tuple) -> AsyncIterator[str]:
        number = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal number
            number += 1
            return f"event: {kind}\ndata: " + json.dumps({"type": kind, "sequence_number": number - 1,
                                                          **fields}) + "\n\n"

        outcome = _Outcome()
        parser = make_parser(parsed.tools)
        thinker = parsed.reasoning.make() if parsed.reasoning is not None else None
        thinking = ReasoningEvents(event)
        outcome.reasoning_id = thinking.item_id
        message_id = conv.new_id("msg")
        message_open = False
        deltas = []  # the tool-call parser's output: its calls, assembled whole at the end

        def open_message(index: int) -> list[str]:
            return [event("response.output_item.added", output_index=index,
                          item=_message_item(message_id, "", "in_progress")),
                    event("response.content_part.added", item_id=message_id, output_index=index, content_index=0,
                          part={"type": "output_text", "text": "", "annotations": []})]
        try:
            yield event("response.created", response=response)
            yield event("response.in_progress", response=response)
            async for chunk in stream:
                outcome.last = chunk
                content = chunk.text
                if thinker is not None:
                    thought, content = thinker.feed(content, len(chunk.token_ids))
                    if chunk.finished:
                        more_thought, more_content = thinker.finish()
                        thought, content = thought + more_thought, content + more_content
                    outcome.num_reasoning_tokens = thinker.num_reasoning_tokens
                    for line in thinking.delta(thought):
                        yield line
                pieces = parser.feed(content) if parser is not None else None
                if parser is not None and chunk.finished:
                    pieces = pieces + parser.finish()
                if pieces is not None:
                    deltas.append(pieces)
                text = content if parser is None else (pieces.content or "")
                if text:
                    for line in thinking.close():
                        yield line
                    if not message_open:
                        message_open = True
                        for line in open_message(thinking.num_items):
                            yield line
                    outcome.text += text
                    yield event("response.output_text.delta", item_id=message_id, output_index=thinking.num_items,
                                content_index=0, delta=text, logprobs=[])
                if chunk.finished:
                    break
            if parser is not None:
                outcome.calls = [_call_item(call) for call in assemble(deltas).tool_calls]
            outcome.reasoning = thinking.text or None
            final = self._finish(response, outcome, message_id)
            for line in thinking.close():
                yield line
            index = 0
            for item in final["output"]:
                if item["type"] == "reasoning":
                    index += 1
                    continue  # sent as it came
                if item["type"] == "message":
                    if not message_open:
                        for line in open_message(index):
                            yield line
                    part = item["content"][0]
                    yield event("response.output_text.done", item_id=message_id, output_index=index,
                                content_index=0, text=part["text"], logprobs=[])
                    yield event("response.content_part.done", item_id=message_id, output_index=index,
                                content_index=0, part=part)
                else:
                    yield event("response.output_item.added", output_index=index,
                                item={**item, "arguments": "", "status": "in_progress"})
                    yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=item["arguments"])
                    yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                arguments=item["arguments"])
                yield event("response.output_item.done", output_index=index, item=item)
                index += 1
            await self._save(context, final)
            kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
            yield event(kind, response=final)
        except Exception as exc:  # noqa: BLE001 - reported in-band: the status is already sent
            err = self._api_error(exc) if isinstance(exc, (StoreUnavailable, ValueError)) else backend_error(exc)
            if err is None:
                logger.error("response stream %s failed", response["id"], exc_info=exc)
                err = internal_error(parsed.request.request_id)
            yield event("error", code=err.code, message=err.message, param=err.param)
        finally:
            await close_stream(stream)

    # ------------------------------------------------------------ stored
    async def _stored(self, request: Request) -> tuple[str, dict]:
        tenant, admission = self.server._admit(request)
        if admission is not None:
            admission.release()
        if self.store is None:
            raise APIError(404, "this server stores no responses", code="response_not_found")
        owner = tenant.name if tenant is not None else "default"
        response_id = request.path_params["response_id"]
        record = await self.store.get(owner, response_id)
        if record is None:
            raise conv.not_found(response_id)
        return owner, await self.background.settle(owner, record)

    async def retrieve(self, request: Request) -> Response:
        try:
            _, record = await self._stored(request)
            return JSONResponse(record["response"])
        except (APIError, StoreUnavailable, PermissionError) as err:
            return error_response(self._api_error(err))

    async def delete(self, request: Request) -> Response:
        try:
            owner, record = await self._stored(request)
            await self.store.delete(owner, record["response"]["id"])
            return JSONResponse({"id": record["response"]["id"], "object": "response.deleted", "deleted": True})
        except (APIError, StoreUnavailable, PermissionError) as err:
            return error_response(self._api_error(err))

    async def input_items(self, request: Request) -> Response:
        try:
            _, record = await self._stored(request)
            items = list(record["input_items"])
            order = request.query_params.get("order", "desc")
            if order not in ("asc", "desc"):
                raise conv.bad_request("order must be asc or desc", "order")
            if order == "desc":
                items.reverse()
            return JSONResponse({"object": "list", "data": items, "has_more": False,
                                 "first_id": items[0]["id"] if items else None,
                                 "last_id": items[-1]["id"] if items else None})
        except (APIError, StoreUnavailable, PermissionError) as err:
            return error_response(self._api_error(err))

    async def cancel(self, request: Request) -> Response:
        try:
            owner, record = await self._stored(request)
            return JSONResponse(await self.background.cancel(owner, record))
        except (APIError, StoreUnavailable, PermissionError) as err:
            return error_response(self._api_error(err))
