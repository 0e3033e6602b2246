"""Chat templates (Jinja, as in ``tokenizer_config.json``), without torch.

Shared by the router (which renders chat requests) and the offline CLI.

Tools (OpenAI ``tools``) reach the prompt in one of two ways:

* The template references ``tools`` (Qwen2.5/3, Llama 3.1+, Hermes, Mistral):
  it is rendered with ``tools=[{"type": "function", "function": {...}}, ...]``
  and messages keep ``tool_calls`` (arguments decoded to objects, as the
  templates expect) and ``tool_call_id``, as Hugging Face's
  ``apply_chat_template`` passes them, so the model sees its trained format.
* Otherwise (ChatML models such as SmolLM2) the built-in Hermes format below,
  worded as Qwen2.5's template words it, is written into plain messages that
  any template renders::

      system     <system content>\\n\\n# Tools\\n\\nYou may call ... <tools>
                 {"type": "function", "function": {...}}     (one line per tool)
                 </tools> ... <tool_call></tool_call> XML tags: ...
                 (a system message of its own when the conversation has none)
      assistant  <content>\\n<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
                 (one block per call, joined by "\\n"; no content line when empty)
      tool       a user turn "<tool_response>\\n<content>\\n</tool_response>"
                 (consecutive tool messages share one user turn, joined by "\\n")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import jinja2
import jinja2.meta
import jinja2.sandbox

ROLES = ("system", "user", "assistant", "tool")
# Variables the renderer sets itself: chat_template_kwargs may not override them.
RESERVED_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools")

# Qwen2.5's tool prompt, word for word: Hermes-trained and Qwen models know it.
TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call>"
)


class ChatTemplate:
    """A compiled chat template with the model's special tokens.

    Args:
        source: The Jinja source.
        bos_token / eos_token: Strings the template may reference.
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        # Hugging Face's tojson: key order kept, no HTML escaping (Jinja's own sorts keys
        # and writes \u003c for "<"), so tool signatures read as the model was trained on.
        env.filters["tojson"] = _tojson
        self._template = env.from_string(source)
        self.source = source
        self.takes_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> Optional["ChatTemplate"]:
        """Reads ``tokenizer_config.json``; None when the model has no template."""
        path = Path(model_dir) / "tokenizer_config.json"
        if not path.is_file():
            return None
        cfg = json.loads(path.read_text())
        source = cfg.get("chat_template")
        if isinstance(source, list):  # named templates: take the default
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not source:
            return None
        return cls(source, _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token")))

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Optional[Sequence[Mapping[str, Any]]] = None,
               template_kwargs: Optional[Mapping[str, Any]] = None) -> str:
        """Renders messages into the prompt text.

        Args:
            messages: ``{"role", "content"}`` mappings; an assistant message may
                carry ``tool_calls`` (OpenAI's shape, ``content`` then may be
                empty), a tool message ``tool_call_id``.
            add_generation_prompt: End with the assistant's turn marker.
            tools: OpenAI tool objects to offer the model (None or empty: none).
            template_kwargs: More variables for the template (a request's
                ``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``).

        Raises:
            ValueError: A message lacks a known role or string content, or
                ``template_kwargs`` names a variable the renderer sets.
        """
        reserved = sorted(set(template_kwargs or ()) & set(RESERVED_TEMPLATE_VARIABLES))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets them")
        if not messages:
            raise ValueError("messages is empty: send at least one message")
        for i, msg in enumerate(messages):
            if msg.get("role") not in ROLES:
                raise ValueError(f"messages[{i}].role must be one of {ROLES}, got {msg.get('role')!r}")
            if not isinstance(msg.get("content"), str):
                raise ValueError(f"messages[{i}].content must be a string")
        plain = [_decoded_calls(m) for m in messages]
        kwargs: dict[str, Any] = dict(template_kwargs or {})
        if self.takes_tools:
            kwargs["tools"] = [dict(t) for t in tools] if tools else None
        else:
            plain = builtin_tool_messages(plain, tools or ())
        try:
            return self._template.render(
                messages=plain,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **kwargs,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template rejected the messages: {exc}") from exc


def tools_block(tools: Sequence[Mapping[str, Any]]) -> str:
    """The built-in system-prompt block that offers ``tools`` (Qwen2.5's wording)."""
    return TOOLS_HEADER + "".join("\n" + _tojson(tool) for tool in tools) + TOOLS_FOOTER


def builtin_tool_messages(messages: Sequence[dict], tools: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Plain ``{"role", "content"}`` messages with tools, calls and results written
    in the built-in Hermes format (see the module docstring), for templates that
    know nothing of tools."""
    out: list[dict] = []
    previous_was_tool = False
    for msg in messages:
        role, content = msg["role"], msg["content"]
        if role == "tool":
            block = "<tool_response>\n" + content + "\n</tool_response>"
            if previous_was_tool:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            previous_was_tool = True
            continue
        previous_was_tool = False
        if role == "assistant" and msg.get("tool_calls"):
            blocks = [_call_block(call) for call in msg["tool_calls"]]
            content = (content + "\n" if content else "") + "\n".join(blocks)
        out.append({"role": role, "content": content})
    if tools:
        if out and out[0]["role"] == "system":
            out[0]["content"] = out[0]["content"] + "\n\n" + tools_block(tools)
        else:
            out.insert(0, {"role": "system", "content": tools_block(tools)})
    return out


def _call_block(call: Mapping[str, Any]) -> str:
    function = call.get("function", call)
    arguments = function.get("arguments")
    # Arguments that were not a JSON object's text stay the string the client sent.
    args_text = arguments if isinstance(arguments, str) else _tojson(arguments)
    return '<tool_call>\n{"name": ' + _tojson(function.get("name")) + ', "arguments": ' + args_text + "}\n</tool_call>"


def _decoded_calls(msg: Mapping[str, Any]) -> dict:
    """A copy of ``msg`` whose tool-call arguments are objects, not JSON text
    (OpenAI sends text; templates write them with ``tojson``, as vLLM passes them)."""
    out = dict(msg)
    calls = out.get("tool_calls")
    if not calls:
        return out
    decoded = []
    for call in calls:
        call = dict(call)
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                value = json.loads(arguments)
            except json.JSONDecodeError:
                value = None
            if isinstance(value, dict):
                function["arguments"] = value
        call["function"] = function
        decoded.append(call)
    out["tool_calls"] = decoded
    return out


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _token_str(token: Any) -> str:
    if isinstance(token, dict):  # AddedToken serialized form
        return str(token.get("content", ""))
    return token or ""
