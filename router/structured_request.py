"""Output constraints of an HTTP request: OpenAI's ``response_format``, vLLM's
``structured_outputs`` object and its deprecated ``guided_*`` fields, read into
one :class:`StructuredOutputsParams` (or None), and the schema checks the
router runs before dispatch (the gRPC path, ``router.convert``, runs them too).

Sources, each a whole constraint; a request may use at most one::

    response_format      {"type": "text"}                      no constraint
                         {"type": "json_object"}               json_object
                         {"type": "json_schema",
                          "json_schema": {"name", "schema",
                                          "strict", "description"}}  json = schema
                         {"type": "structural_tag", ...}       structural_tag = the object (vLLM's)
    structured_outputs   vLLM's object: {"json": ...}, {"regex": ...}, ...
    guided_json / guided_regex / guided_choice / guided_grammar   vLLM's deprecated aliases

A ``structured_outputs`` object that names no kind (only
``disable_any_whitespace`` / ``whitespace_limit``) adds its whitespace knobs
to the other source, as vLLM merges them. ``guided_decoding_backend`` may
only name the backend we run (``xgrammar`` or ``auto``);
``guided_whitespace_pattern`` is refused. Nothing here is ignored: a field we
cannot honour is a :class:`StructuredRequestError` naming it.

A JSON schema is checked twice before dispatch: its syntax with
``jsonschema`` (the draft its ``$schema`` names, else 2020-12; ``pattern``
regexes are left to the engine, whose regex dialect is not Python's), then
:func:`cluster.shared.schema_check.unsupported_schema_features`.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from jsonschema.exceptions import best_match
from jsonschema.validators import Draft202012Validator, validator_for

from cluster.shared.schema_check import unsupported_schema_features
from cluster.shared.structured import KINDS, StructuredOutputsParams

BACKENDS = ("xgrammar", "auto")
_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_KNOBS = ("disable_any_whitespace", "whitespace_limit")
_JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")
MAX_NAMED_FEATURES = 8  # a 400 names this many unsupported features, then counts the rest


class StructuredRequestError(ValueError):
    """A request's output constraint is invalid; ``param`` is the top-level field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def structured_outputs_from_body(body: dict) -> Optional[StructuredOutputsParams]:
    """The output constraint an OpenAI / vLLM request body asks for.

    Args:
        body: The decoded JSON body of ``/v1/completions`` or ``/v1/chat/completions``.

    Returns:
        The validated constraint (its JSON schema checked), or None for none.

    Raises:
        StructuredRequestError: A malformed field, two sources at once, an
            invalid schema or one using a feature the engine cannot enforce.
    """
    _check_backend_fields(body)
    sources = []  # (param, path in messages, kind, value)
    fmt = _response_format(body.get("response_format"))
    if fmt is not None:
        sources.append(("response_format", *fmt))
    knobs: dict[str, Any] = {}
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise StructuredRequestError(
                "structured_outputs must be an object such as {\"json\": {...}} or {\"regex\": \"...\"}",
                "structured_outputs")
        if any(so.get(k) not in (None, False) for k in KINDS):
            sources.append(("structured_outputs", "structured_outputs", None, so))
        else:
            _build("structured_outputs", "structured_outputs", None, {**so, "json_object": True}, {})  # checks keys
            knobs = so
    for alias, kind in _ALIASES.items():
        if body.get(alias) is not None:
            sources.append((alias, alias, kind, body[alias]))
    if len(sources) > 1:
        names = [s[0] for s in sources]
        raise StructuredRequestError(
            f"{' and '.join(names)} each constrain the output: send one of them (drop {', '.join(names[1:])})",
            names[1])
    if not sources:
        if knobs:
            raise StructuredRequestError(
                "structured_outputs sets only whitespace options: add a constraint (json, json_object, regex, "
                "choice, grammar or structural_tag) or response_format, or leave structured_outputs unset",
                "structured_outputs")
        return None
    param, path, kind, value = sources[0]
    params = _build(param, path, kind, value, knobs)
    if params.json is not None:
        try:
            check_json_schema(params.schema(), path)
        except ValueError as exc:
            raise StructuredRequestError(str(exc), param) from None
    return params


def _check_backend_fields(body: dict) -> None:
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise StructuredRequestError(
            f"guided_decoding_backend {backend!r} is not available: this server enforces constraints with "
            "xgrammar; set it to \"xgrammar\" or \"auto\", or leave it unset", "guided_decoding_backend")
    if body.get("guided_whitespace_pattern") is not None:
        raise StructuredRequestError(
            "guided_whitespace_pattern is not supported: leave it unset (structured_outputs."
            "disable_any_whitespace gives compact JSON)", "guided_whitespace_pattern")


def _response_format(fmt: Any) -> Optional[tuple[str, str, Any]]:
    """``(path, kind, value)`` of ``response_format``, or None for none / ``text``."""
    if fmt is None:
        return None
    example = "such as {\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": {...}}"
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise StructuredRequestError(f"response_format must be an object with a type, {example}", "response_format")
    kind = fmt["type"]
    if kind == "structural_tag":  # vLLM's: the whole object is the tag, as vLLM passes it on
        return "response_format", "structural_tag", fmt
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}.get(kind)
    if allowed is None:
        raise StructuredRequestError(
            f"response_format.type {kind!r} is not supported: use text, json_object, json_schema or "
            "structural_tag", "response_format")
    extra = sorted(set(fmt) - allowed)
    if extra:
        them = "it" if len(extra) == 1 else "them"
        raise StructuredRequestError(f"response_format of type {kind} does not take {', '.join(extra)}: remove {them}",
                                     "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", "json_object", True
    return "response_format.json_schema.schema", "json", _json_schema_format(fmt.get("json_schema"))


def _json_schema_format(spec: Any) -> dict:
    """The schema of ``response_format.json_schema`` (its other fields checked, then unused)."""
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise StructuredRequestError(f"{where} must be an object with a schema: {{\"name\": ..., \"schema\": {{...}}}}",
                                     "response_format")
    extra = sorted(set(spec) - set(_JSON_SCHEMA_KEYS))
    if extra:
        raise StructuredRequestError(f"{where} does not take {', '.join(extra)}: its fields are "
                                     f"{', '.join(_JSON_SCHEMA_KEYS)}", "response_format")
    for name in ("name", "description"):
        if spec.get(name) is not None and not isinstance(spec[name], str):
            raise StructuredRequestError(f"{where}.{name} must be a string", "response_format")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise StructuredRequestError(f"{where}.strict must be true or false", "response_format")
    schema = spec.get("schema")
    if schema is None:
        raise StructuredRequestError(f"{where}.schema is required: send the JSON schema the output must match",
                                     "response_format")
    if not isinstance(schema, dict):
        raise StructuredRequestError(f"{where}.schema must be a JSON schema object, got {type(schema).__name__}",
                                     "response_format")
    return schema


def _build(param: str, path: str, kind: Optional[str], value: Any, knobs: dict) -> StructuredOutputsParams:
    """The params of one source plus the knob-only ``structured_outputs`` object (if any)."""
    if kind is None:  # the structured_outputs object itself
        mapping = value
    else:
        if kind == "choice" and (isinstance(value, str) or not isinstance(value, list)):
            raise StructuredRequestError(f"{path} must be a list of strings", param)
        if kind == "json" and not isinstance(value, (dict, str)):
            raise StructuredRequestError(f"{path} must be a JSON schema (an object or its JSON text)", param)
        mapping = {**knobs, kind: value}
    try:
        return StructuredOutputsParams.from_mapping(mapping)
    except ValueError as exc:
        message = str(exc)
        if kind is not None and f"structured_outputs.{kind}" in message:
            raise StructuredRequestError(re.sub(rf"structured_outputs\.{kind}\b", path, message), param) from None
        raise StructuredRequestError(message, "structured_outputs" if kind is None or knobs else param) from None


def check_json_schema(schema: Any, field: str) -> None:
    """Checks a JSON schema's syntax and that the engine can enforce all of it.

    Args:
        schema: The schema (a dict or a bool).
        field: How the client names it, e.g. ``response_format.json_schema.schema``.

    Raises:
        ValueError: The schema is not valid for its draft (the validator's
            message and where), or it uses features the engine cannot enforce
            (each named with its JSON path).
    """
    cls = validator_for(schema, default=Draft202012Validator) if isinstance(schema, dict) else Draft202012Validator
    # No format checker: `pattern` regexes would be checked with Python's `re`, not the engine's dialect.
    error = best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    if error is not None:
        draft = re.sub(r"Draft(\d{4})(\d\d)|Draft(\d+)", lambda m: "draft " + (m[3] or f"{m[1]}-{m[2]}"),
                       cls.__name__.removesuffix("Validator"))
        raise ValueError(f"{field} is not a valid JSON Schema ({draft}): {error.message} at {error.json_path}")
    problems = unsupported_schema_features(schema)
    if problems:
        named = ", ".join(problems[:MAX_NAMED_FEATURES])
        if len(problems) > MAX_NAMED_FEATURES:
            named += f" and {len(problems) - MAX_NAMED_FEATURES} more"
        raise ValueError(f"{field} uses {named}, which structured outputs cannot enforce: remove "
                         f"{'it' if len(problems) == 1 else 'them'} from the schema")

