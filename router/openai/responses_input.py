"""A ``/v1/responses`` request as the chat completion it runs as.

The Responses API is a chat completion with another shape: ``input`` (a
string, or a list of items) and ``instructions`` become chat messages (the
instructions a system message first), ``previous_response_id`` puts the stored
conversation before them, and the sampling fields take their chat names.
The chat body then goes through the chat path already there (limits, chat
template, tools, structured outputs), so both APIs tokenize a conversation
the same way and a continued conversation extends the previous prompt token
for token (its KV is in some replica's prefix cache).

    input item                        chat message
    "text" / {"role", "content"}      {"role", "content"} (developer -> system;
      content parts input_text /        parts joined)
      output_text
    {"type": "function_call"}         assistant message with tool_calls
    {"type": "function_call_output"}  {"role": "tool", "tool_call_id", "content"}
    {"type": "reasoning"}             dropped (the model's own reasoning is not fed back)

The request is validated once, as a whole, before any of this
(``responses_models.py``: a field we do not honour is a 400 naming it); the
functions here convert a valid request. ``reasoning.effort`` becomes chat's
``reasoning_effort`` (``router.reasoning.effort_template_kwargs``: Qwen3's
``enable_thinking``).
"""

from __future__ import annotations

import uuid
from typing import Any, Optional

from router.openai.protocol import APIError, bad_request  # noqa: F401 - bad_request: the API's, as conv.bad_request
from router.openai.responses_models import parse_create


def new_id(prefix: str) -> str:
    """An id as OpenAI's look (``resp_…``, ``msg_…``, ``fc_…``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def check_create(body: Any) -> dict:
    """The create body, validated whole (``responses_models.parse_create``), as a
    dict of the fields set (``input`` as a list of items, defaults filled in).

    Raises:
        APIError: 400 naming the field and what to change.
    """
    return parse_create(body).model_dump(exclude_none=True, by_alias=True)


def input_items(items: list[dict]) -> list[dict]:
    """The validated input items, each with an ``id`` (a new one where the client sent none)."""
    return [{**item, "id": item.get("id") or new_id("fc" if item["type"] == "function_call" else "msg")}
            for item in items]


def _text_of(content: Any) -> str:
    return content if isinstance(content, str) else "".join(part["text"] for part in content)


def chat_messages(items: list[dict]) -> list[dict]:
    """Input items -> chat messages (see the module doc)."""
    messages: list[dict] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            role = item["role"]
            messages.append({"role": "system" if role == "developer" else role, "content": _text_of(item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text_of(item["output"])})
    return messages


def _chat_tools(tools: Optional[list]) -> Optional[list]:
    if not tools:
        return None
    return [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}} for tool in tools]


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: Optional[dict]) -> Optional[dict]:
    fmt = (text or {}).get("format") or {"type": "text"}
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def chat_body(body: dict, history: list[dict], messages: list[dict]) -> dict:
    """The chat completion body of a create request: instructions, the stored
    conversation (``history``), then this input's ``messages``."""
    chat: dict[str, Any] = {"messages": ([{"role": "system", "content": body["instructions"]}]
                                         if body.get("instructions") else []) + history + messages}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    renames = {"max_output_tokens": "max_completion_tokens", "temperature": "temperature", "top_p": "top_p",
               "parallel_tool_calls": "parallel_tool_calls", "user": "user"}
    chat.update({chat_name: body[name] for name, chat_name in renames.items() if body.get(name) is not None})
    tools = _chat_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    return chat


# Chat fields a create request sets under another name: a 400 the chat path raises names the Responses field.
_RESPONSES_NAMES = {"reasoning_effort": "reasoning.effort", "max_completion_tokens": "max_output_tokens"}


def responses_names(err: APIError) -> APIError:
    """``err`` of the chat path as the Responses API names its fields."""
    name = _RESPONSES_NAMES.get(err.param or "")
    if name is None:
        return err
    return APIError(err.status, err.message.replace(err.param or "", name), name.split(".")[0], err.type, err.code,
                    err.headers)


def not_found(response_id: str) -> APIError:
    return APIError(404, f"no response {response_id!r} (unknown, deleted, expired, or another tenant's)",
                    "previous_response_id", code="response_not_found", type_="invalid_request_error")
