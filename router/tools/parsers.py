"""Tool calls out of model output, one parser per format and tool_choice.

    parser        when                      the output
    ------        ----                      ----------
    Hermes        auto, hermes format       text <tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call> ...
    Llama3Json    auto, llama3_json format  {"name": N, "parameters": {...}}; {"name": ...}  (from the start)
    Required      tool_choice "required"    [{"name": N, "parameters": {...}}, ...]  (constrained)
    Named         tool_choice {function}    {...}  the arguments themselves          (constrained)

Rules the anchors (vLLM's hermes / llama3_json parsers) lacked:

* A call ends where its JSON object closes, found by a string-aware brace
  scan then ``json.loads``, never by splitting on ``</tool_call>``: a literal
  ``</tool_call>`` or ``}`` inside an argument does not cut the call.
* Text between an object and ``</tool_call>`` ("Extra data", e.g. one brace
  too many) is dropped: it is inside the tag. A second object in one tag is a
  second call.
* A call that never closes (max_tokens), is not JSON, or names no offered
  tool stays content, tag and all; later well-formed calls still count.
* Whitespace around calls is dropped (content "Sure!\\n\\n<tool_call>" is
  "Sure!"); so that the stream agrees, trailing whitespace and a possible
  start of ``<tool_call>`` are held back until the next text decides them.
* Auto and required calls are emitted whole, once their object closes, with
  ``arguments`` = ``json.dumps(args, ensure_ascii=False)``: a call streamed
  is never one that turns out broken. Named calls stream every text piece as
  arguments (the output is the arguments, verbatim; cut at max_tokens they
  are cut too, and finish_reason says "length", as OpenAI does).
"""

from __future__ import annotations

from typing import Callable, Optional

from router.tools.calls import (
    ObjectScanner,
    ParserDelta,
    ToolCallDelta,
    ToolCallParser,
    ToolOutput,
    assemble,
    new_call_id,
    partial_suffix,
    skip_whitespace,
)
from router.tools.plan import ToolPlan

START, END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.x writes it before a call (it is gone when special tokens are skipped)


class HermesParser(ToolCallParser):
    """``<tool_call>`` blocks anywhere in free text (ChatML, Qwen, Hermes, the built-in block)."""

    def __init__(self, plan: ToolPlan, make_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(plan, make_id)
        self._state = "content"
        self._scan_from = 0  # where to look for the next <tool_call>
        self._pos = 0  # inside a tag: the next character to read
        self._revert = 0  # where content resumes if the current call turns out broken
        self._tag_at: Optional[int] = None  # the <tool_call> of the current object (None: a second object)
        self._scanner: Optional[ObjectScanner] = None

    def _advance(self, out: ParserDelta, final: bool) -> None:
        step = {"content": self._content, "open": self._open, "object": self._object, "after": self._after}
        while step[self._state](out, final):
            pass

    def _content(self, out: ParserDelta, final: bool) -> bool:
        text = self.text
        k = text.find(START, self._scan_from)
        if k >= 0:
            self._revert = len(text[:k].rstrip()) if k > self._emit_from else k
            self._revert = max(self._revert, self._emit_from)
            self._emit(out, self._revert)  # whitespace before the tag is held until the call is decided
            self._pos, self._tag_at, self._state = k + len(START), k, "open"
            return True
        if final:
            end = len(text.rstrip()) if self._saw_call else len(text)  # no whitespace after the last call
            self._emit(out, max(end, self._emit_from))
            self._emit_from = len(text)
            return False
        hold_from = len(text) - partial_suffix(text, START)
        self._scan_from = max(hold_from, self._emit_from)
        self._emit(out, max(len(text[:hold_from].rstrip()), self._emit_from))
        return False

    def _open(self, out: ParserDelta, final: bool) -> bool:
        i = skip_whitespace(self.text, self._pos)
        if i == len(self.text):
            return self._broken() if final else False
        if self.text[i] != "{":
            return self._broken()
        self._scanner, self._state = ObjectScanner(i), "object"
        return True

    def _object(self, out: ParserDelta, final: bool) -> bool:
        assert self._scanner is not None
        end = self._scanner.scan(self.text)
        if end is None:
            return self._broken() if final else False
        call = self._decode(self.text[self._scanner.start:end])
        if call is None:
            return self._broken()
        self._call(out, *call)
        self._pos = self._revert = self._emit_from = end
        self._state = "after"
        return True

    def _after(self, out: ParserDelta, final: bool) -> bool:
        text = self.text
        i = skip_whitespace(text, self._pos)
        if text.startswith("{", i):  # several objects in one tag
            self._scanner, self._tag_at, self._state = ObjectScanner(i), None, "object"
            return True
        close, reopen = text.find(END, i), text.find(START, i)
        if reopen >= 0 and (close < 0 or reopen < close):  # the closing tag was left out
            return self._resume(i)
        if close >= 0:  # anything before the closing tag ("Extra data") is inside the tag: dropped
            return self._resume(close + len(END))
        if not final:
            return False
        junk = text[i:].rstrip()
        junk = junk[:len(junk) - partial_suffix(junk, END)]  # a closing tag cut by max_tokens
        if not junk.strip().strip("}]"):  # and surplus braces: inside the tag, dropped
            self._emit_from = len(text)
            self._state = "content"
            self._scan_from = len(text)
            return True
        return self._resume(i)

    def _resume(self, at: int) -> bool:
        self._emit_from = self._scan_from = at
        self._after_call()
        self._state = "content"
        return True

    def _broken(self) -> bool:
        """Not a call after all: its text is content, searched again for later calls."""
        self._emit_from = self._revert
        # Search again after the broken call's own tag (a second object of one tag has none).
        self._scan_from = self._revert if self._tag_at is None else self._tag_at + 1
        self._scanner = None
        self._state = "content"
        return True


class Llama3JsonParser(ToolCallParser):
    """Llama 3.x: the answer is calls (``{"name", "parameters"}`` separated by ``;``)
    when it starts with ``{`` or ``<|python_tag|>``, else plain content."""

    def __init__(self, plan: ToolPlan, make_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(plan, make_id)
        self._state = "start"
        self._pos = 0
        self._revert = 0
        self._scanner: Optional[ObjectScanner] = None

    def _advance(self, out: ParserDelta, final: bool) -> None:
        step = {"start": self._start, "object": self._object, "after": self._after, "content": self._content}
        while step[self._state](out, final):
            pass

    def _start(self, out: ParserDelta, final: bool) -> bool:
        text = self.text
        i = skip_whitespace(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_whitespace(text, i + len(PYTHON_TAG))
        elif PYTHON_TAG.startswith(text[i:]) and not final:
            return False  # maybe the tag, maybe not
        if i == len(text) and not final:
            return False
        if text.startswith("{", i):
            self._scanner, self._state = ObjectScanner(i), "object"
        else:
            self._state = "content"
        return True

    def _object(self, out: ParserDelta, final: bool) -> bool:
        assert self._scanner is not None
        end = self._scanner.scan(self.text)
        if end is None:
            if final:
                self._state = "content"  # cut at max_tokens: content from the last call on
            return final
        call = self._decode(self.text[self._scanner.start:end])
        if call is None:
            self._state = "content"
            return True
        self._call(out, *call)
        self._pos = self._revert = self._emit_from = end
        self._after_call()
        self._state = "after"
        return True

    def _after(self, out: ParserDelta, final: bool) -> bool:
        i = skip_whitespace(self.text, self._pos)
        if self.text.startswith(";", i):
            i = skip_whitespace(self.text, i + 1)
        if i == len(self.text):
            if final:
                self._emit_from = len(self.text)
            return False
        self._revert = i  # a broken call or text after the calls is content from here
        if self.text.startswith("{", i):
            self._scanner, self._state = ObjectScanner(i), "object"
            return True
        self._state = "content"
        return True

    def _content(self, out: ParserDelta, final: bool) -> bool:
        self._emit_from = max(self._emit_from, self._revert)
        self._emit(out, len(self.text))
        return False


class RequiredParser(ToolCallParser):
    """``tool_choice: "required"``: a JSON array of ``{"name", "parameters"}``, each
    call emitted when its object closes; a cut-off rest stays content."""

    args_keys = ("parameters", "arguments")

    def __init__(self, plan: ToolPlan, make_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(plan, make_id)
        self._state = "start"
        self._pos = 0
        self._revert = 0
        self._scanner: Optional[ObjectScanner] = None

    def _advance(self, out: ParserDelta, final: bool) -> None:
        while self._step(out, final):
            pass

    def _step(self, out: ParserDelta, final: bool) -> bool:
        text = self.text
        if self._state == "content":
            self._emit_from = max(self._emit_from, self._revert)
            self._emit(out, len(text))
            return False
        if self._state == "done":
            self._emit_from = len(text)  # after "]": the grammar ended the output
            return False
        if self._state == "object":
            assert self._scanner is not None
            end = self._scanner.scan(text)
            call = self._decode(text[self._scanner.start:end]) if end is not None else None
            if call is None:
                if end is None and not final:
                    return False
                self._state = "content"
                return True
            self._call(out, *call)
            self._pos = self._revert = self._emit_from = end
            self._after_call()
            self._state = "array"
            return True
        i = skip_whitespace(text, self._pos)
        while self._state == "array" and text.startswith(",", i):
            i = skip_whitespace(text, i + 1)
        if i == len(text):
            if final:
                self._state = "content"
            return final
        if self._state == "start":
            self._pos, self._state = i + 1, ("array" if text[i] == "[" else "content")
        elif text[i] == "]":
            self._state = "done"
        elif text[i] == "{":
            self._scanner, self._state = ObjectScanner(i), "object"
            self._revert = i if self.num_calls else self._revert  # a cut-off element is content from its brace
        else:
            self._state = "content"
        return True


class NamedParser(ToolCallParser):
    """``tool_choice`` naming a function: every piece of text is a piece of its arguments."""

    def _advance(self, out: ParserDelta, final: bool) -> None:
        piece = self.text[self._emit_from:]
        self._emit_from = len(self.text)
        if self.num_calls == 0 and (piece or final):
            out.tool_calls.append(ToolCallDelta(0, piece, self.make_id(), self.plan.function_name))
            self.num_calls = 1
        elif piece:
            out.tool_calls.append(ToolCallDelta(0, piece))


def make_parser(plan: Optional[ToolPlan], make_id: Callable[[], str] = new_call_id) -> Optional[ToolCallParser]:
    """The parser for a request's output, or None when its output is plain content
    (no tools, or ``tool_choice: "none"``)."""
    if plan is None or plan.choice == "none":
        return None
    if plan.choice == "function":
        return NamedParser(plan, make_id)
    if plan.choice == "required":
        return RequiredParser(plan, make_id)
    return Llama3JsonParser(plan, make_id) if plan.parser == "llama3_json" else HermesParser(plan, make_id)


def parse_tool_output(plan: Optional[ToolPlan], text: str,
                      make_id: Callable[[], str] = new_call_id) -> Optional[ToolOutput]:
    """The content and calls of a whole output, or None when ``plan`` parses none."""
    parser = make_parser(plan, make_id)
    if parser is None:
        return None
    return assemble([parser.feed(text), parser.finish()])


def tool_finish_reason(reason: Optional[str], num_calls: int) -> Optional[str]:
    """OpenAI's finish reason: ``tool_calls`` when calls were made and the output
    ended by itself; ``length`` (cut) and the rest unchanged."""
    return "tool_calls" if num_calls and reason == "stop" else reason
