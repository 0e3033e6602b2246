"""Structured-output constraints as plain data (no torch): what a request asks
its output to match. The engine enforces them (``workers/structured/``); the
router and the offline API build them from vLLM's and OpenAI's request fields.

Names follow vLLM's ``StructuredOutputsParams`` so a vLLM user's requests
work unchanged: exactly one of

    json            a JSON schema (a dict, or its JSON text)
    json_object     any JSON object (OpenAI's ``{"type": "json_object"}``)
    regex           a regular expression the whole output matches
    choice          one of these strings, exactly
    grammar         an EBNF / GBNF grammar (``root ::= ...``)
    structural_tag  a structural tag (vLLM / xgrammar format, its JSON text):
                    free text with constrained segments between triggers

A reasoning model's think block comes before the constraint when the router
sets ``reasoning`` (never a request field; ``router/reasoning.py`` decides it
from the rendered prompt):

    None        the constraint holds from the output's first token
    "optional"  the output may open with a whole ``<think>…</think>`` block
    "open"      the output starts inside a think block (the prompt opened it):
                any text up to the first ``</think>``

then at most ``REASONING_GAP`` whitespace characters, then the constraint, so
it applies to the content after the reasoning, as a reasoning parser splits it.

And the whitespace of JSON: compact by default (one space after ``:`` and
``,``, as ``json.dumps`` writes it), so a model cannot emit newlines until
``max_tokens`` (vllm#38696) and the forced text between values is long enough
for jump-forward decoding; ``whitespace_limit=N`` allows any whitespace, at
most N characters between two JSON tokens. ``disable_any_whitespace``
(vLLM's knob) keeps JSON compact even with a limit.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any, Optional

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_CHOICES = 1024
MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar of more than 1 MiB is refused
REASONING_MODES = ("optional", "open")
THINK_TAGS = ("<think>", "</think>")
REASONING_GAP = 4  # whitespace between </think> and the constrained content (Qwen3 writes "\n\n")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One request's output constraint (exactly one kind set).

    Args:
        json: A JSON schema: a dict (serialized here, key order kept) or JSON text.
        json_object: True for any JSON object.
        regex: A regular expression for the whole output.
        choice: The output is exactly one of these strings.
        grammar: An EBNF / GBNF grammar with a ``root`` rule.
        structural_tag: A structural tag, as a dict or its JSON text.
        disable_any_whitespace: Compact JSON whatever ``whitespace_limit`` says.
        whitespace_limit: None (the default) for compact JSON; N allows any
            whitespace, at most N characters between JSON tokens.
        reasoning: None, or the think block before the constraint
            (``REASONING_MODES``; set by the router, see above).

    Raises:
        ValueError: None or several kinds set, or a value of the wrong type;
            the message names the field.
    """

    json: Optional[str] = None
    json_object: bool = False
    regex: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None
    grammar: Optional[str] = None
    structural_tag: Optional[str] = None
    disable_any_whitespace: bool = False
    whitespace_limit: Optional[int] = None
    reasoning: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                if not isinstance(value, (dict, bool)):
                    raise ValueError(f"structured_outputs.{name} must be a JSON object or its JSON text, "
                                     f"got {type(value).__name__}")
                object.__setattr__(self, name, _json.dumps(value, ensure_ascii=False, separators=(",", ":")))
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise ValueError("structured_outputs.choice must be a list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        self._validate()

    def _validate(self) -> None:
        kinds = self.kinds_set()
        if len(kinds) != 1:
            got = ", ".join(kinds) if kinds else "none"
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; got {got}")
        for name in ("json", "regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, str) or not value.strip():
                    raise ValueError(f"structured_outputs.{name} must be a non-empty string")
                if len(value) > MAX_SPEC_CHARS:
                    raise ValueError(f"structured_outputs.{name} has {len(value)} characters: at most "
                                     f"{MAX_SPEC_CHARS} are allowed")
        if self.json is not None:
            try:
                schema = _json.loads(self.json)
            except _json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema (an object), "
                                 f"got {type(schema).__name__}")
        if self.structural_tag is not None:
            try:
                tag = _json.loads(self.structural_tag)
            except _json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.structural_tag is not valid JSON: {exc}") from None
            if not isinstance(tag, dict):
                raise ValueError("structured_outputs.structural_tag must be a JSON object")
        if self.choice is not None:
            if not self.choice or len(self.choice) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice must hold 1 to {MAX_CHOICES} strings, "
                                 f"got {len(self.choice)}")
            if any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a list of non-empty strings")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be true or false")
        limit = self.whitespace_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 256):
            raise ValueError(f"structured_outputs.whitespace_limit must be an integer in [1, 256] or unset, "
                             f"got {self.whitespace_limit!r}")
        if self.reasoning is not None and self.reasoning not in REASONING_MODES:
            raise ValueError(f"structured_outputs.reasoning must be one of {', '.join(REASONING_MODES)} or unset, "
                             f"got {self.reasoning!r}")

    def validate(self) -> None:
        """Checks every field again (an unpickled copy skipped ``__post_init__``)."""
        self._validate()

    def kinds_set(self) -> list[str]:
        """The kinds this object sets (one when valid)."""
        return [k for k in KINDS if (getattr(self, k) if k == "json_object" else getattr(self, k) is not None)]

    @property
    def kind(self) -> str:
        return self.kinds_set()[0]

    @property
    def spec(self) -> str:
        """The constraint as one string (with ``kind``, the grammar cache's key)."""
        kind = self.kind
        if kind == "json_object":
            return ""
        if kind == "choice":
            return _json.dumps(list(self.choice or ()), ensure_ascii=False)
        return getattr(self, kind)

    @property
    def cache_key(self) -> tuple[str, str, Optional[int], Optional[str]]:
        """What the compiled grammar depends on."""
        return (self.kind, self.spec, None if self.disable_any_whitespace else self.whitespace_limit, self.reasoning)

    def schema(self) -> Any:
        """The JSON schema as a Python object (``json`` only)."""
        return _json.loads(self.json) if self.json is not None else None

    @classmethod
    def from_mapping(cls, mapping: Any, field: str = "structured_outputs") -> "StructuredOutputsParams":
        """From vLLM's ``structured_outputs`` request object (a dict).

        Raises:
            ValueError: Not an object, an unknown key (named), or a bad value.
        """
        if not isinstance(mapping, dict):
            raise ValueError(f"{field} must be an object such as {{\"json\": {{...}}}} or {{\"regex\": \"...\"}}")
        known = {"json", "json_object", "regex", "choice", "grammar", "structural_tag", "disable_any_whitespace",
                 "whitespace_limit"}
        ignored_defaults = {"disable_fallback": False, "disable_additional_properties": False,
                            "whitespace_pattern": None}
        kwargs = {}
        for key, value in mapping.items():
            if key in ignored_defaults:
                if value not in (ignored_defaults[key], None):
                    raise ValueError(f"{field}.{key} is not supported: leave it unset")
                continue
            if key not in known:
                raise ValueError(f"unknown {field} key {key!r}; known keys: {', '.join(sorted(known))}")
            if value is None or (key == "json_object" and value is False):
                continue
            kwargs[key] = value
        return cls(**kwargs)
