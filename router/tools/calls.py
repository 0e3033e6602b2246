"""Tool calls as parsers emit them: stream deltas, whole calls, and the shared
pieces of every parser (call ids, a JSON object scanner, the incremental base).

Every parser is incremental: ``feed(text)`` per streamed piece, then
``finish()``; each returns a :class:`ParserDelta` (content text and
tool-call deltas, OpenAI's streaming shape). A non-streamed response feeds
the whole text once, so streamed and whole answers are the same by
construction and differ only in how the text was cut (tests cut it everywhere).
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

from router.tools.plan import ToolPlan

CALL_ID_CHARS = string.ascii_letters + string.digits
_WHITESPACE = " \t\r\n"


def new_call_id() -> str:
    """``call_`` + 24 random alphanumerics (OpenAI's shape)."""
    return "call_" + "".join(secrets.choice(CALL_ID_CHARS) for _ in range(24))


@dataclass
class ToolCallDelta:
    """One piece of a streamed call: the first carries ``id`` and ``name``."""

    index: int
    arguments: str = ""
    id: Optional[str] = None
    name: Optional[str] = None

    def body(self) -> dict[str, Any]:
        """``delta.tool_calls[i]`` as OpenAI streams it."""
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out.update(id=self.id, type="function")
        if self.name is not None:
            function = {"name": self.name, "arguments": self.arguments}
        out["function"] = function
        return out


@dataclass
class ParserDelta:
    """What one ``feed`` / ``finish`` produced."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __add__(self, other: "ParserDelta") -> "ParserDelta":
        return ParserDelta(self.content + other.content, self.tool_calls + other.tool_calls)


@dataclass(frozen=True)
class ToolCall:
    """A whole call (``message.tool_calls[i]``)."""

    id: str
    name: str
    arguments: str  # JSON text

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolOutput:
    """A whole answer: ``content`` None when it is empty and calls were made."""

    content: Optional[str]
    tool_calls: tuple[ToolCall, ...]


def assemble(deltas: Iterable[ParserDelta]) -> ToolOutput:
    """Joins deltas into the answer a client assembles from the stream."""
    content, calls = [], {}
    for delta in deltas:
        content.append(delta.content)
        for piece in delta.tool_calls:
            if piece.index not in calls:
                assert piece.id is not None and piece.name is not None, "a call's first delta names it"
                calls[piece.index] = [piece.id, piece.name, ""]
            calls[piece.index][2] += piece.arguments
    text = "".join(content)
    whole = tuple(ToolCall(*calls[i]) for i in sorted(calls))
    return ToolOutput(text if text or not whole else None, whole)


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``
    (text held back: it may become the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ObjectScanner:
    """Finds where the JSON object starting at ``text[start] == "{"`` ends, over
    text that grows. Braces inside strings do not count, so a literal
    ``</tool_call>`` or ``}`` inside an argument never ends a call early."""

    def __init__(self, start: int) -> None:
        self.start = start
        self._pos = start
        self._depth = 0
        self._in_string = False
        self._escape = False

    def scan(self, text: str) -> Optional[int]:
        """The index after the closing brace, or None while the object is open."""
        depth, in_string, escape = self._depth, self._in_string, self._escape
        for i in range(self._pos, len(text)):
            c = text[i]
            if in_string:
                if escape:
                    escape = False
                elif c == "\\":
                    escape = True
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    self._pos = i + 1
                    return i + 1
        self._pos, self._depth, self._in_string, self._escape = len(text), depth, in_string, escape
        return None


class ToolCallParser:
    """The base of the incremental parsers: the text so far, content emission, calls.

    Args:
        plan: The request's tool plan (tool names, ``parallel``).
        make_id: Call ids (tests inject a counter).

    Subclasses implement ``_advance(out, final)``: consume as much of
    ``self.text`` as is decided, appending to ``out``.
    """

    args_keys = ("arguments", "parameters")

    def __init__(self, plan: ToolPlan, make_id: Callable[[], str] = new_call_id) -> None:
        self.plan = plan
        self.make_id = make_id
        self.text = ""
        self.num_calls = 0
        self._saw_call = False  # a call was decided (kept, or dropped by parallel_tool_calls=false)
        self._emit_from = 0  # text before this index is decided (emitted or dropped)
        self._strip_leading = False  # drop whitespace that follows a call (while no content came before it)
        self._emitted_any = False  # some content was emitted

    def feed(self, text: str) -> ParserDelta:
        """Consumes the next piece of output."""
        self.text += text
        out = ParserDelta()
        self._advance(out, final=False)
        return out

    def finish(self) -> ParserDelta:
        """Decides everything held back (the generation ended)."""
        out = ParserDelta()
        self._advance(out, final=True)
        return out

    def _advance(self, out: ParserDelta, final: bool) -> None:
        raise NotImplementedError

    def _emit(self, out: ParserDelta, end: int) -> None:
        """Emits ``text[_emit_from:end]`` as content (leading whitespace after a call dropped)."""
        piece = self.text[self._emit_from:end]
        self._emit_from = max(self._emit_from, end)
        if self._strip_leading:
            piece = piece.lstrip(_WHITESPACE)
            self._strip_leading = not piece
        self._emitted_any = self._emitted_any or bool(piece)
        out.content += piece

    def _after_call(self) -> None:
        """Whitespace right after a call is dropped unless content came before it
        (which it then separates from the content that follows)."""
        self._strip_leading = not self._emitted_any

    def _call(self, out: ParserDelta, name: str, arguments: str) -> None:
        self._saw_call = True
        if self.num_calls and not self.plan.parallel:
            return  # parallel_tool_calls=false: OpenAI returns one call; later ones are dropped
        out.tool_calls.append(ToolCallDelta(self.num_calls, arguments, self.make_id(), name))
        self.num_calls += 1

    def _decode(self, raw: str) -> Optional[tuple[str, str]]:
        """``(name, arguments JSON)`` of a call object, or None when it is not a call
        of an offered tool (then its text stays content)."""
        try:
            obj = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or self.plan.tool(obj["name"]) is None:
            return None
        args: Any = next((obj[k] for k in self.args_keys if k in obj), {})
        if isinstance(args, str):  # some models write the arguments as JSON text
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return obj["name"], json.dumps(args, ensure_ascii=False)
