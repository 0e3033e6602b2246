"""Reasoning split from content: ``<think>…</think>`` of Qwen3 / DeepSeek-R1 style models.

A reasoning model writes its thinking before the answer. The router's
``reasoning_parser`` (vLLM's ``--reasoning-parser`` names) splits the output
text, chunk by chunk, into ``reasoning`` and ``content``:

    parser       output starts in   reasoning is
    qwen3        content            inside <think>…</think> at the start of the
                                    output (no tag there: all of it is content)
    deepseek_r1  reasoning          everything up to </think> (a leading <think>,
                                    which older templates let the model write, is
                                    dropped; no </think> at all: all reasoning)

Whatever the parser, a prompt whose rendered tail opens ``<think>`` (QwQ,
DeepSeek-R1's newer template) starts the output in reasoning, and one whose
tail closes it (Qwen3 with ``enable_thinking: false`` writes an empty
``<think></think>``) starts it in content with nothing to split.

Reasoning tokens (``usage.*_tokens_details.reasoning_tokens``) are counted from
the chunks fed with their token counts: a chunk's tokens are reasoning when the
parser is inside the think block after it, or when it completes ``</think>``
(the tags are reasoning tokens); tokens held before the output's first text
decides (leading whitespace, part of ``<think>``) follow that decision. With one
token per chunk, as a replica streams without speculation, the count is exact.

Whitespace around the tags is dropped (``<think>\\n…\\n</think>\\n\\n`` gives
neither a leading nor a trailing newline), and a tag split across chunks at
any position is recognized: text that may be the start of a tag is held until
the next chunk (or :meth:`ReasoningParser.finish`) decides. Streamed and whole
outputs split identically.

Under a grammar (structured outputs, a required or named tool choice, strict
tools) the constraint holds the content after the reasoning, not the
reasoning: :func:`constrain_after_reasoning` sets the request's
``structured_outputs.reasoning`` from the mode, and the engine compiles the
think block before the grammar (``cluster/shared/structured.py``):

    the prompt             the output           grammar's reasoning
    closed the block       all content          None: the grammar from the first token
    opened the block       starts in reasoning  "open": any text, </think>, then the grammar
    neither (qwen3)        may open <think>     "optional": a whole block or none, then the grammar
    neither (deepseek_r1)  starts in reasoning  "open"

so the split this parser makes and the grammar agree: the content it returns
is what the grammar held. (vLLM instead starts applying the grammar once the
model emits the end tag's token id; a grammar over text works for tags of any
number of tokens and is checked token by token in the same matcher.)

``auto`` picks from the chat template: a template that writes
``<｜Assistant｜>`` and mentions ``<think>`` or ``</think>`` is DeepSeek-R1's
(the first R1 templates only strip ``</think>`` from earlier turns), any other
that mentions either tag or ``enable_thinking`` is Qwen3-like; one that mentions neither
gets no parser (all content).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from cluster.shared.structured import THINK_TAGS
from cluster.shared.types import SamplingParams

OPEN_TAG, CLOSE_TAG = THINK_TAGS
REASONING_PARSERS = ("qwen3", "deepseek_r1")

_OPENING, _REASONING_LEAD, _REASONING, _CONTENT_LEAD, _CONTENT = range(5)


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")  # OpenAI's reasoning_effort values
_NO_THINKING = ("none", "minimal")


def effort_template_kwargs(effort: str, template_source: Optional[str]) -> dict:
    """The chat-template variables that carry OpenAI's ``reasoning_effort`` to a model.

    As vLLM does, the effort itself reaches a template that reads
    ``reasoning_effort``; a template with Qwen3's switch gets ``enable_thinking``
    false for ``none`` / ``minimal`` and true for ``low`` / ``medium`` / ``high``
    (it has no levels between). A template with neither can honour only what
    the model does anyway: thinking for a template that writes think tags
    (DeepSeek-R1 always thinks), none for one that does not.

    Raises:
        ValueError: An unknown effort, or one this model cannot honour.
    """
    if effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}")
    source = template_source or ""
    kwargs: dict = {}
    if "reasoning_effort" in source:
        kwargs["reasoning_effort"] = effort
    if "enable_thinking" in source:
        kwargs["enable_thinking"] = effort not in _NO_THINKING
    if kwargs:
        return kwargs
    thinks = resolve_reasoning_parser("auto", source) is not None
    if thinks != (effort in _NO_THINKING):
        return {}
    if thinks:
        raise ValueError(f"reasoning_effort {effort!r} cannot be honoured: this model always thinks (its chat "
                         "template has no switch to turn thinking off); use low, medium or high, or leave it unset")
    raise ValueError(f"reasoning_effort {effort!r} cannot be honoured: this model does not reason (its chat "
                     "template writes no think block); use none, or leave it unset")


def resolve_reasoning_parser(name: Optional[str], template_source: Optional[str]) -> Optional[str]:
    """The parser a router setting means for this model (None: no reasoning split).

    Args:
        name: ``none`` (or None / ""), ``auto``, ``qwen3`` or ``deepseek_r1``.
        template_source: The model's chat template source (for ``auto``).

    Raises:
        ValueError: An unknown name.
    """
    if name in (None, "", "none"):
        return None
    if name in REASONING_PARSERS:
        return name
    if name != "auto":
        raise ValueError(f"reasoning_parser must be one of none, auto, {', '.join(REASONING_PARSERS)}; got {name!r}")
    source = template_source or ""
    if (OPEN_TAG in source or CLOSE_TAG in source) and "｜Assistant｜" in source:
        return "deepseek_r1"
    if OPEN_TAG in source or CLOSE_TAG in source or "enable_thinking" in source:
        return "qwen3"
    return None


@dataclass(frozen=True)
class ReasoningMode:
    """How one request's output is split: the parser, and whether the prompt left
    the model inside a think block. :meth:`make` gives a fresh parser per choice."""

    parser: str
    start_in_reasoning: bool = False
    no_reasoning: bool = False  # the prompt closed the think block: all content

    @classmethod
    def for_prompt(cls, parser: Optional[str], prompt_tail: str) -> Optional["ReasoningMode"]:
        """The mode of a request whose rendered prompt ends with ``prompt_tail``
        (None when ``parser`` is None)."""
        if parser is None:
            return None
        tail = prompt_tail.rstrip()
        if tail.endswith(CLOSE_TAG):
            return cls(parser, no_reasoning=True)
        return cls(parser, start_in_reasoning=parser == "deepseek_r1" or tail.endswith(OPEN_TAG))

    @property
    def grammar_reasoning(self) -> Optional[str]:
        """``StructuredOutputsParams.reasoning`` of this mode: the think block a
        grammar lets through before its constraint (None: no block)."""
        if self.no_reasoning:
            return None
        return "open" if self.start_in_reasoning else "optional"

    def make(self) -> "ReasoningParser":
        return ReasoningParser(self.start_in_reasoning, self.no_reasoning)


class ReasoningParser:
    """Splits one choice's output text into reasoning and content, chunk by chunk.

    :meth:`feed` mutates the parser (it holds back text that may start a tag);
    :meth:`finish` flushes what is held at the end of the output.

    Args:
        start_in_reasoning: The output begins inside a think block.
        no_reasoning: Everything is content (the prompt closed the block).
    """

    def __init__(self, start_in_reasoning: bool = False, no_reasoning: bool = False) -> None:
        self.start_in_reasoning = start_in_reasoning
        self._state = _CONTENT if no_reasoning else _OPENING
        self._held = ""
        self.reasoning = ""  # all reasoning so far
        self.content = ""  # all content so far
        self.num_reasoning_tokens = 0
        self._num_undecided_tokens = 0  # fed while the output's first text was held (_OPENING)

    def feed(self, text: str, num_tokens: int = 0) -> tuple[str, str]:
        """``(reasoning, content)`` that ``text`` (the next piece of output, of
        ``num_tokens`` tokens) releases."""
        reasoning, content, closed = self._feed(text)
        self._count(num_tokens, closed)
        return reasoning, content

    def _count(self, num_tokens: int, closed: bool) -> None:
        if self._state == _OPENING:
            self._num_undecided_tokens += num_tokens
            return
        undecided, self._num_undecided_tokens = self._num_undecided_tokens, 0
        if closed or self._state in (_REASONING_LEAD, _REASONING):
            self.num_reasoning_tokens += undecided + num_tokens

    def _feed(self, text: str) -> tuple[str, str, bool]:
        buf = self._held + text
        self._held = ""
        reasoning = content = ""
        closed = False
        while buf:
            if self._state == _OPENING:
                stripped = buf.lstrip()
                if stripped.startswith(OPEN_TAG):
                    buf, self._state = stripped[len(OPEN_TAG):], _REASONING_LEAD
                elif OPEN_TAG.startswith(stripped):  # only whitespace, or part of the tag: wait
                    self._held, buf = buf, ""
                else:
                    self._state = _REASONING_LEAD if self.start_in_reasoning else _CONTENT
            elif self._state in (_REASONING_LEAD, _CONTENT_LEAD):
                buf = buf.lstrip()
                if buf:
                    self._state = _REASONING if self._state == _REASONING_LEAD else _CONTENT
            elif self._state == _REASONING:
                end = buf.find(CLOSE_TAG)
                if end >= 0:
                    reasoning += buf[:end].rstrip()
                    buf, self._state = buf[end + len(CLOSE_TAG):], _CONTENT_LEAD
                    closed = True
                    continue
                keep = _partial_tag_len(buf, CLOSE_TAG)
                released = buf[:len(buf) - keep].rstrip()  # trailing whitespace may precede </think>
                reasoning += released
                self._held, buf = buf[len(released):], ""
            else:
                content += buf
                buf = ""
        self.reasoning += reasoning
        self.content += content
        return reasoning, content, closed

    def finish(self) -> tuple[str, str]:
        """``(reasoning, content)`` still held when the output ended (a tag's
        beginning that never completed is text)."""
        held, self._held = self._held, ""
        reasoning = content = ""
        if self._state == _OPENING:
            if self.start_in_reasoning:
                reasoning = held.strip()
                self.num_reasoning_tokens += self._num_undecided_tokens
            else:
                content = held
            self._num_undecided_tokens = 0
        elif self._state == _REASONING:
            reasoning = held.rstrip()
        self.reasoning += reasoning
        self.content += content
        return reasoning, content


def constrain_after_reasoning(params: SamplingParams, mode: Optional[ReasoningMode]) -> SamplingParams:
    """``params`` with its output constraint (if any) moved after the think block
    ``mode`` expects (unchanged without a constraint, a mode, or a block)."""
    constraint = params.structured_outputs
    if constraint is None or mode is None or mode.grammar_reasoning is None:
        return params
    return dataclasses.replace(params, structured_outputs=dataclasses.replace(
        constraint, reasoning=mode.grammar_reasoning))


def split_reasoning(mode: Optional[ReasoningMode], text: str) -> tuple[Optional[str], str]:
    """``(reasoning or None, content)`` of a whole output (``mode`` None: all content)."""
    reasoning, content, _ = split_pieces(mode, [(text, 0)])
    return reasoning, content


def split_pieces(mode: Optional[ReasoningMode], pieces: list[tuple[str, int]]) -> tuple[Optional[str], str, int]:
    """``(reasoning or None, content, reasoning tokens)`` of an output collected as
    ``(text, number of tokens)`` pieces, split as their stream is (``mode`` None: all content)."""
    if mode is None:
        return None, "".join(text for text, _ in pieces), 0
    parser = mode.make()
    for text, num_tokens in pieces:
        parser.feed(text, num_tokens)
    parser.finish()
    return parser.reasoning or None, parser.content, parser.num_reasoning_tokens


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
