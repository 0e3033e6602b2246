"""OpenAI ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` validated into a
:class:`ToolPlan`, and the tool calls of a chat history checked.

Defaults and refusals (OpenAI's where it has them, vLLM's where it is silent):

    tool_choice            default "auto" with tools, "none" without; "none"
                           without tools is accepted (vLLM does), anything
                           else without tools is refused
    parallel_tool_calls    default true
    tools                  at most MAX_TOOLS = 128 (OpenAI's limit); names unique,
                           ^[a-zA-Z0-9_-]{1,64}$; parameters a JSON schema of an
                           object (default: no parameters); unknown keys refused
                           (a field we would not honour is an error, not ignored)
    functions / function_call  deprecated: refused with a pointer to tools

Every error is a :class:`ToolError` (a ``ValueError``) whose ``param`` names
the request field; the HTTP and gRPC edges turn it into 400 / INVALID_ARGUMENT.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
CHOICES = ("none", "auto", "required")
PARSERS = ("hermes", "llama3_json")
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A bad tools-related request field.

    Args:
        message: What is wrong and what to change.
        param: The request field at fault (``tools``, ``tool_choice``, ...).
    """

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call."""

    name: str
    parameters: dict  # a JSON schema of an object
    description: Optional[str] = None
    strict: bool = False

    def prompt_object(self) -> dict:
        """The tool as the chat template sees it (OpenAI's shape, ``strict`` left out)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolPlan:
    """What a request asks of tool calling.

    Attributes:
        tools: The offered functions, in request order.
        choice: ``none`` | ``auto`` | ``required`` | ``function`` (one named function).
        function_name: The forced function when ``choice == "function"``.
        parallel: Whether several calls may be returned (``parallel_tool_calls``).
        parser: The output format of free-text calls: ``hermes`` or ``llama3_json``.
    """

    tools: tuple[ToolSpec, ...]
    choice: str
    function_name: Optional[str] = None
    parallel: bool = True
    parser: str = "hermes"

    def tool(self, name: str) -> Optional[ToolSpec]:
        """The tool called ``name``, or None."""
        return next((t for t in self.tools if t.name == name), None)

    def prompt_tools(self) -> list[dict]:
        """The tools for the chat template (rendered for every choice, ``none`` too, as vLLM does)."""
        return [t.prompt_object() for t in self.tools]


def resolve_parser(name: str, template_source: Optional[str]) -> str:
    """The tool-call output format for a model.

    Args:
        name: ``auto``, ``hermes`` or ``llama3_json`` (a router flag's value).
        template_source: The model's chat template; ``auto`` picks
            ``llama3_json`` for Llama 3.x templates (header ids and
            ``<|eot_id|>``), else ``hermes`` (ChatML, Qwen, Hermes, and the
            built-in block every template without tools gets).

    Raises:
        ValueError: An unknown name.
    """
    if name in PARSERS:
        return name
    if name != "auto":
        raise ValueError(f"tool_call_parser must be one of auto, {', '.join(PARSERS)}; got {name!r}")
    source = template_source or ""
    if "<|start_header_id|>" in source and "<|eot_id|>" in source and "tools" in source:
        return "llama3_json"
    return "hermes"


def parse_tool_plan(body: Mapping[str, Any], parser: str = "hermes") -> Optional[ToolPlan]:
    """The tool plan of a chat request, or None when it offers no tools.

    Args:
        body: The request (OpenAI chat completions fields).
        parser: A resolved output format (see :func:`resolve_parser`).

    Raises:
        ToolError: Naming the field: bad tool definitions, a tool_choice that
            is unknown or names an unknown tool or comes without tools,
            a non-boolean parallel_tool_calls, or deprecated functions.
    """
    for old in ("functions", "function_call"):
        if body.get(old) is not None:
            raise ToolError(f"{old} is deprecated and not supported: send tools=[{{\"type\": \"function\", "
                            "\"function\": {\"name\": ..., \"parameters\": {...}}}] and tool_choice instead", old)
    tools = _parse_tools(body.get("tools"))
    choice, function_name = _parse_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise ToolError(f"parallel_tool_calls must be true or false, got {parallel!r}", "parallel_tool_calls")
    if not tools:
        return None
    return ToolPlan(tools, choice, function_name, parallel, parser)


def _parse_tools(value: Any) -> tuple[ToolSpec, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ToolError("tools must be a list of {\"type\": \"function\", \"function\": {...}} objects", "tools")
    if len(value) > MAX_TOOLS:
        raise ToolError(f"tools has {len(value)} tools: at most {MAX_TOOLS} are allowed", "tools")
    specs: list[ToolSpec] = []
    for i, tool in enumerate(value):
        spec = _parse_tool(tool, f"tools[{i}]")
        if any(s.name == spec.name for s in specs):
            raise ToolError(f"tools[{i}].function.name {spec.name!r} is given twice: tool names must be unique",
                            "tools")
        specs.append(spec)
    return tuple(specs)


def _parse_tool(tool: Any, where: str) -> ToolSpec:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ToolError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}: only function "
                        "tools are supported", "tools")
    if set(tool) - {"type", "function"}:
        raise ToolError(f"{where} has unknown keys {sorted(set(tool) - {'type', 'function'})}: "
                        "send only type and function", "tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ToolError(f"{where}.function must be an object with name and parameters", "tools")
    unknown = set(function) - _FUNCTION_KEYS
    if unknown:
        raise ToolError(f"{where}.function has unknown keys {sorted(unknown)}: known keys are "
                        f"{', '.join(sorted(_FUNCTION_KEYS))}", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise ToolError(f"{where}.function.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}", "tools")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{where}.function.description must be a string", "tools")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = dict(_EMPTY_PARAMETERS)
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ToolError(f"{where}.function.parameters must be a JSON schema of an object "
                        "({\"type\": \"object\", \"properties\": {...}})", "tools")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolError(f"{where}.function.strict must be true or false", "tools")
    return ToolSpec(name, parameters, description, bool(strict))


def _parse_choice(value: Any, tools: tuple[ToolSpec, ...]) -> tuple[str, Optional[str]]:
    if value is None:
        return ("auto" if tools else "none"), None
    if not tools and value != "none":
        raise ToolError("tool_choice needs tools: send tools, or leave tool_choice unset", "tool_choice")
    if isinstance(value, str):
        if value not in CHOICES:
            raise ToolError(f"tool_choice must be one of {', '.join(CHOICES)} or {{\"type\": \"function\", "
                            f"\"function\": {{\"name\": ...}}}}, got {value!r}", "tool_choice")
        return value, None
    function = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ToolError("tool_choice must be none, auto, required or {\"type\": \"function\", "
                        "\"function\": {\"name\": ...}}", "tool_choice")
    if not any(t.name == name for t in tools):
        known = ", ".join(t.name for t in tools)
        raise ToolError(f"tool_choice names the function {name!r}, which is not in tools ({known}): "
                        "name one of them", "tool_choice")
    return "function", name


def message_tool_fields(msg: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The tool fields of one chat-history message, checked: ``tool_calls`` of an
    assistant message, ``tool_call_id`` of a tool message ({} for others).

    Raises:
        ToolError: (param ``messages``) tool_calls on another role, a bad call,
            or a tool message without the id of the call it answers.
    """
    role = msg.get("role")
    if msg.get("tool_calls") is not None:
        if role != "assistant":
            raise ToolError(f"{where}.tool_calls is only allowed on assistant messages", "messages")
        return {"tool_calls": check_tool_calls(msg["tool_calls"], where)}
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ToolError(f"{where}.tool_call_id must be the id of the call this tool message answers", "messages")
        return {"tool_call_id": call_id}
    return {}


def check_tool_calls(value: Any, where: str) -> list[dict]:
    """The ``tool_calls`` of an assistant message in a chat history, checked.

    Args:
        value: The message's ``tool_calls``.
        where: Its position for messages (``messages[3]``).

    Returns:
        ``[{"id", "type": "function", "function": {"name", "arguments"}}]``;
        arguments stay the client's JSON text.

    Raises:
        ToolError: (param ``messages``) naming the bad call and field.
    """
    if not isinstance(value, list):
        raise ToolError(f"{where}.tool_calls must be a list of tool calls", "messages")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise ToolError(f"{at} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                            "\"arguments\"}}}}", "messages")
        name, arguments = function.get("name"), function.get("arguments", "{}")
        if not isinstance(name, str) or not name:
            raise ToolError(f"{at}.function.name must be a non-empty string", "messages")
        if not isinstance(arguments, str):
            raise ToolError(f"{at}.function.arguments must be a string (the arguments' JSON text)", "messages")
        call_id = call.get("id", "")
        if not isinstance(call_id, str):
            raise ToolError(f"{at}.id must be a string", "messages")
        calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return calls
