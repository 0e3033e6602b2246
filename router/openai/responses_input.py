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

A field we do not honour is a 400 naming it: built-in tools (web search,
file search, code interpreter, computer use, MCP), ``background`` with
``stream`` or without ``store``, ``reasoning.summary``, ``include``, images and files in the input,
``truncation: auto``. ``reasoning.effort`` becomes chat's ``reasoning_effort``
(``router.reasoning.effort_template_kwargs``: Qwen3's ``enable_thinking``).
"""

from __future__ import annotations

import uuid
from typing import Any, Optional

from router.openai.protocol import APIError, bad_request

# The fields of a create request: honoured, or refused below when set to what we cannot do.
KNOWN_FIELDS = {
    "model", "input", "instructions", "previous_response_id", "store", "stream", "max_output_tokens",
    "temperature", "top_p", "tools", "tool_choice", "parallel_tool_calls", "text", "metadata", "user",
    "truncation", "background", "reasoning", "include", "service_tier", "stream_options",
}
_UNSUPPORTED_WHEN_SET = {
    "include": "include is not supported: leave it unset",
}
MAX_METADATA_KEYS = 16


def new_id(prefix: str) -> str:
    """An id as OpenAI's look (``resp_…``, ``msg_…``, ``fc_…``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def check_create(body: Any) -> dict:
    """The create body, checked for fields and types we honour.

    Raises:
        APIError: 400 naming the field and what to change.
    """
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise bad_request(f"unknown or unsupported field {unknown[0]!r} for /v1/responses: remove it", unknown[0])
    for name, message in _UNSUPPORTED_WHEN_SET.items():
        if body.get(name):
            raise bad_request(message, name)
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request("truncation 'auto' is not supported: leave it unset or 'disabled' (a prompt over the "
                          "model's length is a 400)", "truncation")
    if "input" not in body:
        raise bad_request("input is required: a string or a list of input items", "input")
    for name in ("store", "stream", "parallel_tool_calls", "background"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise bad_request(f"{name} must be true or false", name)
    for name in ("instructions", "previous_response_id", "user"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise bad_request(f"{name} must be a string", name)
    if body.get("background") and body.get("store") is False:
        raise bad_request("a background response is stored (it is polled by id): leave store unset or true",
                          "store")
    if body.get("background") and body.get("stream"):
        raise bad_request("streaming a background response is not supported: poll it with GET "
                          "/v1/responses/{id}, or leave background unset", "stream")
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
            raise bad_request("reasoning must be an object like {\"effort\": \"low\"}", "reasoning")
        for name in ("summary", "generate_summary"):
            if reasoning.get(name) is not None:
                raise bad_request(f"reasoning.{name} is not supported (the reasoning is returned whole, not "
                                  "summarized): leave it unset", "reasoning")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_KEYS
                                 or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise bad_request(f"metadata must be an object of at most {MAX_METADATA_KEYS} string keys and values",
                          "metadata")
    return body


def input_items(raw: Any) -> list[dict]:
    """The request's input as a list of items, each with an ``id``.

    Raises:
        APIError: 400 for an input that is neither a string nor a list of items.
    """
    if isinstance(raw, str):
        return [{"type": "message", "id": new_id("msg"), "role": "user",
                 "content": [{"type": "input_text", "text": raw}]}]
    if not isinstance(raw, list) or not raw:
        raise bad_request("input must be a string or a non-empty list of input items", "input")
    items = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}] must be an object (an input item)", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in ("message", "function_call", "function_call_output", "reasoning"):
            raise bad_request(f"input[{i}] has type {kind!r}: supported items are message, function_call, "
                              "function_call_output (and reasoning, which is dropped)", "input")
        items.append({**item, "type": kind, "id": item.get("id") or new_id("fc" if kind == "function_call" else "msg")})
    return items


def _text_of(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"input[{i}].content must be a string or a list of content parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise bad_request(f"input[{i}].content has a part of type {kind!r}: only text parts (input_text, "
                              "output_text) are supported", "input")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def chat_messages(items: list[dict]) -> list[dict]:
    """Input items -> chat messages (see the module doc)."""
    messages: list[dict] = []
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "reasoning":
            continue
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"input[{i}].role must be user, system, developer or assistant, got {role!r}",
                                  "input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(item.get("content", ""), i)})
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                if not isinstance(item.get(name), str):
                    raise bad_request(f"input[{i}] (function_call) needs a string {name}", "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"input[{i}] (function_call_output) needs a string call_id", "input")
            output = item.get("output", "")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else _text_of(output, i)})
    return messages


def _chat_tools(tools: Any) -> Optional[list]:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of function tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(f"tools[{i}] has type {kind!r}: only function tools are supported (no built-in tools "
                              "such as web search, file search, code interpreter, computer use or MCP)", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
                      "tool_choice")


def _response_format(text: Any) -> Optional[dict]:
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise bad_request("text must be an object with format", "text")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request(f"text.format.type must be text, json_object or json_schema, got {kind!r}", "text")


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
