"""gRPC tool calling: the proto's tool fields in and out, through ``router/tools``,
the HTTP API's code, so both front ends validate, render, constrain and parse alike.

    GenerateRequest.tools / tool_choice / tool_choice_function / parallel_tool_calls
        ──tools_body──▶ OpenAI's body fields ──parse_tool_plan──▶ ToolPlan
        ──constrain──▶ SamplingParams.structured_outputs (required / named / strict)
    ChatMessage.tool_calls / tool_call_id / name
        ──chat_message──▶ the chat template's message (``message_tool_fields``)
    StreamChunk + its GenerateResponse
        ──ToolCallStream.rewrite──▶ text = content, tool_calls = the calls that
                                    completed in this chunk, finish_reason tool_calls

The proto spells some fields differently from OpenAI's JSON:

    proto                              OpenAI
    -----                              ------
    tools[i].name / description /      tools[i].function.name / description /
      parameters_json (JSON text)        parameters (an object) / strict
      / strict
    tool_choice "function" +           tool_choice {"type": "function",
      tool_choice_function NAME          "function": {"name": NAME}}
    ChatMessage.tool_calls[j]          messages[i].tool_calls[j]
      .id / .name / .arguments           .id / .function.name / .function.arguments

Errors are :class:`ToolError` (a ``ValueError``: INVALID_ARGUMENT) whose
message starts with the proto's field (``tools[0].parameters_json``,
``tool_choice_function``, ``messages.items[2].tool_call_id``).
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Optional

from cluster.shared.types import SamplingParams, StreamChunk
from router.pb import generation_pb2 as pb
from router.tokenizer import RouterTokenizer
from router.tools import (ToolCallParser, ToolError, ToolPlan, apply_tool_constraint, make_parser, message_tool_fields,
                          new_call_id, parse_tool_plan, resolve_parser, tool_finish_reason)
from router.tools.plan import CHOICES


def tools_body(msg: pb.GenerateRequest) -> dict[str, Any]:
    """The request's tool fields as OpenAI's body has them ({} when none is set).

    Raises:
        ToolError: ``parameters_json`` that is not JSON, or a ``tool_choice``
            that is unknown or disagrees with ``tool_choice_function``.
    """
    body: dict[str, Any] = {}
    if msg.tools:
        body["tools"] = [_tool_body(tool, i) for i, tool in enumerate(msg.tools)]
    choice, function = msg.tool_choice, msg.tool_choice_function
    if function:
        if choice not in ("", "function"):
            raise ToolError(f"tool_choice_function names {function!r} but tool_choice is {choice!r}: set "
                            "tool_choice to \"function\" or leave it empty", "tool_choice")
        body["tool_choice"] = {"type": "function", "function": {"name": function}}
    elif choice == "function":
        raise ToolError("tool_choice_function is empty: tool_choice \"function\" needs the name of the function "
                        "to call", "tool_choice_function")
    elif choice:
        if choice not in CHOICES:
            raise ToolError(f"tool_choice must be one of {', '.join(CHOICES)} or function (with "
                            f"tool_choice_function), got {choice!r}", "tool_choice")
        body["tool_choice"] = choice
    if msg.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = msg.parallel_tool_calls
    return body


def _tool_body(tool: pb.Tool, i: int) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters_json:
        try:
            function["parameters"] = json.loads(tool.parameters_json)
        except ValueError as exc:
            raise ToolError(f"tools[{i}].parameters_json is not JSON ({exc}): send a JSON schema of an object "
                            "as text, or leave it empty for no parameters", "tools") from None
    if tool.strict:
        function["strict"] = True
    return {"type": "function", "function": function}


def tool_plan_from_proto(msg: pb.GenerateRequest, tokenizer: RouterTokenizer) -> Optional[ToolPlan]:
    """The request's tool plan, or None when it offers no tools.

    The output format is the tokenizer's ``tool_call_parser`` (the router's
    ``--tool-call-parser``), ``auto`` resolved from the chat template.

    Raises:
        ToolError: A bad tool field (see :func:`tools_body` and
            ``parse_tool_plan``), or tool fields without messages input.
    """
    body = tools_body(msg)
    if not body:
        return None
    if msg.WhichOneof("input") != "messages":
        name = next(iter(body))  # tools, tool_choice or parallel_tool_calls
        if name == "tool_choice" and msg.tool_choice_function:
            name = "tool_choice_function"
        raise ToolError(f"{name} needs messages input (tools are rendered by the chat template): send messages, "
                        "or leave the tool fields unset", name)
    template = tokenizer.chat_template
    try:
        parser = resolve_parser(getattr(tokenizer, "tool_call_parser", "auto"), template.source if template else None)
        return parse_tool_plan(body, parser)
    except ToolError as exc:
        text = proto_names(str(exc))
        if msg.tool_choice_function:  # parse_tool_plan says tool_choice where the proto has tool_choice_function
            text = text.replace("tool_choice names the function", "tool_choice_function names the function")
        raise ToolError(text, exc.param) from None


def constrain(params: SamplingParams, plan: Optional[ToolPlan]) -> SamplingParams:
    """``apply_tool_constraint`` (``tool_choice`` required / named, strict tools)
    with the proto's field in its error.

    Raises:
        ToolError: (``tool_choice``) ``sampling.structured_outputs`` is set too.
    """
    try:
        return apply_tool_constraint(params, plan)
    except ToolError as exc:
        raise ToolError(str(exc).replace("response_format / structured_outputs", "sampling.structured_outputs"),
                        exc.param) from None


def chat_message(item: pb.ChatMessage, i: int) -> dict[str, Any]:
    """One message as the chat template takes it, tool calls and results checked
    as the HTTP API checks them; an empty ``arguments`` is ``{}``.

    Raises:
        ToolError: (param ``messages``) tool_calls on a message that is not the
            assistant's, tool_call_id on one that is not a tool's, a tool
            message without tool_call_id, or a call without a name.
    """
    where = f"messages.items[{i}]"
    msg: dict[str, Any] = {"role": item.role, "content": item.content}
    if item.tool_calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments or "{}"}}
                             for c in item.tool_calls]
    if item.tool_call_id:
        if item.role != "tool":
            raise ToolError(f"{where}.tool_call_id is only allowed on tool messages (it names the call a tool "
                            "result answers)", "messages")
        msg["tool_call_id"] = item.tool_call_id
    try:
        fields = message_tool_fields(msg, where)
    except ToolError as exc:
        raise ToolError(proto_names(str(exc)), exc.param) from None
    out = {"role": item.role, "content": item.content, **fields}
    if item.name:
        out["name"] = item.name
    return out


def proto_names(text: str) -> str:
    """An error of ``router/tools`` with OpenAI's field paths in the proto's spelling."""
    text = re.sub(r"(tools\[\d+\])\.function\.parameters\b", r"\1.parameters_json", text)
    return re.sub(r"(\[\d+\])\.function\.", r"\1.", text)


class ToolCallStream:
    """Reads a request's output chunk by chunk for calls (gRPC's shape of the
    HTTP API's stream: whole calls, never argument pieces).

    Auto and required parsers emit each call whole when its object closes: it
    goes out on that chunk. A named function's output is its arguments, so its
    one call goes out on the last chunk.

    Args:
        parser: The request's parser (``make_parser``; not None).
    """

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser
        self._named = parser.plan.choice == "function"
        self._pending: dict[int, list[str]] = {}  # index -> [id, name, arguments] of calls not sent yet

    @classmethod
    def of(cls, plan: Optional[ToolPlan], make_id: Callable[[], str] = new_call_id) -> Optional["ToolCallStream"]:
        """The stream reader of ``plan``, or None when its output is plain text
        (no tools, or ``tool_choice`` none)."""
        parser = make_parser(plan, make_id)
        return cls(parser) if parser is not None else None

    def rewrite(self, response: pb.GenerateResponse, chunk: StreamChunk) -> pb.GenerateResponse:
        """Feeds ``chunk`` to the parser and rewrites ``response`` (its proto, as
        ``chunk_to_proto`` built it) in place: ``text`` becomes the content,
        completed calls are added, and on the last chunk ``finish_reason`` is
        ``tool_calls`` when calls were made and the output ended by itself.

        Returns:
            ``response``.
        """
        ended = chunk.finish_reason is not None  # this choice ended (others may go on)
        delta = self._parser.feed(response.text)  # the content, after any reasoning split
        if ended:
            delta = delta + self._parser.finish()
        response.text = delta.content
        for piece in delta.tool_calls:
            if piece.index not in self._pending:
                assert piece.id is not None and piece.name is not None, "a call's first delta names it"
                self._pending[piece.index] = [piece.id, piece.name, ""]
            self._pending[piece.index][2] += piece.arguments
        if ended or not self._named:
            for index in sorted(self._pending):
                call_id, name, arguments = self._pending[index]
                response.tool_calls.add(id=call_id, name=name, arguments=arguments)
            self._pending.clear()
        if ended:
            response.finish_reason = tool_finish_reason(response.finish_reason, self._parser.num_calls) or ""
        return response
