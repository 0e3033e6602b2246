"""JSON schemas for structured-output tests and benchmarks, generated from a
seed: nested objects, arrays with ``minItems`` / ``maxItems``, ``enum``,
``const``, ``anyOf``, string ``pattern`` / ``format`` / lengths, integer and
number ranges, ``required`` and ``additionalProperties: false``, ``$defs``
with ``$ref``. Every schema is one of these features or a mix, named after
what it covers, so a failure points at the feature.

Also the prompts that go with them (``schema_prompt``) and vLLM's
structured-output benchmark datasets (``json``, ``json-unique``, ``regex``,
``choice``) as (prompt, constraint, validator) triples.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any, Callable

import jsonschema

WORDS = ["name", "city", "title", "color", "status", "label", "owner", "kind", "note", "code", "team", "place"]
FORMATS = ["date", "time", "date-time", "email", "uuid", "ipv4", "uri"]
ENUMS = [["red", "green", "blue"], ["low", "medium", "high"], ["open", "closed"], ["cat", "dog", "bird", "fish"]]
PATTERNS = [r"^[A-Z]{3}-[0-9]{2}$", r"^[a-z]+$", r"^\d{4}$", r"^(yes|no)$"]
SHAPES = ("scalars", "ranges", "enum", "array", "nested", "anyof", "pattern", "format", "defs", "mixed")


def _scalar(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "const"])
    if kind == "enum":
        return {"enum": rng.choice(ENUMS)}
    if kind == "const":
        return {"const": rng.choice(["v1", 7, True])}
    if kind == "string" and rng.random() < 0.5:
        return {"type": "string", "minLength": rng.randint(1, 3), "maxLength": rng.randint(4, 12)}
    return {"type": kind}


def _object(rng: random.Random, props: dict[str, Any], closed: bool = True) -> dict[str, Any]:
    names = list(props)
    required = names if rng.random() < 0.7 else rng.sample(names, max(1, len(names) // 2))
    schema: dict[str, Any] = {"type": "object", "properties": props, "required": required}
    if closed:
        schema["additionalProperties"] = False
    return schema


def _keys(rng: random.Random, n: int) -> list[str]:
    return rng.sample(WORDS, n)


def make_schema(shape: str, rng: random.Random) -> dict[str, Any]:
    """One schema of ``shape`` (one of ``SHAPES``)."""
    keys = _keys(rng, rng.randint(2, 4))
    if shape == "scalars":
        return _object(rng, {k: _scalar(rng) for k in keys})
    if shape == "ranges":
        props = {}
        for k in keys:
            low = rng.randint(-50, 50)
            if rng.random() < 0.5:
                props[k] = {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 200)}
            else:
                props[k] = {"type": "number", "exclusiveMinimum": float(low), "maximum": low + 10.5}
        return _object(rng, props)
    if shape == "enum":
        return _object(rng, {k: {"enum": rng.choice(ENUMS)} for k in keys})
    if shape == "array":
        low = rng.randint(0, 2)
        return _object(rng, {keys[0]: {"type": "array", "items": _scalar(rng), "minItems": low,
                                       "maxItems": low + rng.randint(1, 3)},
                             **{k: _scalar(rng) for k in keys[1:]}})
    if shape == "nested":
        inner = _object(rng, {k: _scalar(rng) for k in _keys(rng, 2)})
        return _object(rng, {keys[0]: inner, keys[1]: {"type": "array", "items": inner, "maxItems": 2}})
    if shape == "anyof":
        return _object(rng, {keys[0]: {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]},
                             keys[1]: {"anyOf": [{"enum": rng.choice(ENUMS)}, {"type": "null"}]}})
    if shape == "pattern":
        return _object(rng, {k: {"type": "string", "pattern": rng.choice(PATTERNS)} for k in keys})
    if shape == "format":
        return _object(rng, {k: {"type": "string", "format": rng.choice(FORMATS)} for k in keys[:2]})
    if shape == "defs":
        item = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1}, "tag": _scalar(rng)},
                "required": ["id", "tag"], "additionalProperties": False}
        return {"$defs": {"item": item}, **_object(rng, {keys[0]: {"$ref": "#/$defs/item"},
                                                          keys[1]: {"type": "array", "items": {"$ref": "#/$defs/item"},
                                                                    "minItems": 1, "maxItems": 2}})}
    mixed = [make_schema(s, rng) for s in rng.sample(SHAPES[:-2], 2)]  # a nested $ref would not resolve
    return _object(rng, {keys[0]: mixed[0], keys[1]: mixed[1]})


def make_schemas(num: int, seed: int = 0) -> list[tuple[str, dict[str, Any]]]:
    """``num`` schemas, the shapes in turn: ``(shape, schema)``; each is a valid
    Draft 2020-12 schema (checked)."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        shape = SHAPES[i % len(SHAPES)]
        schema = make_schema(shape, rng)
        jsonschema.Draft202012Validator.check_schema(schema)
        out.append((shape, schema))
    return out


def schema_prompt(schema: dict[str, Any]) -> str:
    """A chat question asking for an instance of ``schema``."""
    return f"Write one JSON object that matches this JSON schema, and nothing else:\n{json.dumps(schema)}"


def validates(schema: dict[str, Any], text: str) -> bool:
    """Whether ``text`` is JSON that ``schema`` accepts (formats checked)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    return jsonschema.Draft202012Validator(schema, format_checker=checker).is_valid(value)


Validator = Callable[[str], bool]

# vLLM's structured-output benchmark schema (benchmarks/structured_schemas/structured_schema_1.json), in spirit.
SERVE_SCHEMA = {"type": "object", "additionalProperties": False,
                "properties": {"name": {"type": "string"}, "email": {"type": "string", "format": "email"},
                               "street": {"type": "string"}, "city": {"type": "string"},
                               "state": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                               "phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{3}-[0-9]{4}$"},
                               "website": {"type": "string"}, "company": {"type": "string"},
                               "age": {"type": "integer", "minimum": 18, "maximum": 99}},
                "required": ["name", "email", "street", "city", "state", "zip", "phone", "website", "company",
                             "age"]}
REGEX = r"\w+@\w+\.com\n"
CHOICES = ["Positive", "Negative"]


def structured_dataset(name: str, num: int, seed: int = 0) -> list[tuple[str, dict[str, Any], Validator]]:
    """vLLM's ``bench serve`` structured-output datasets: ``(question,
    structured_outputs mapping, validator)``. ``json-unique`` adds a
    different required property to each schema, so the grammar cache cannot
    help."""
    rng = random.Random(seed)
    out = []
    for i in range(num):
        if name in ("json", "json-unique"):
            schema = json.loads(json.dumps(SERVE_SCHEMA))
            if name == "json-unique":
                key = f"id_{seed}_{i}"
                schema["properties"][key] = {"type": "integer"}
                schema["required"].append(key)
            question = f"Generate an example of a customer profile as JSON ({rng.randint(1, 999)}):\n" \
                       f"{json.dumps(schema)}"
            out.append((question, {"json": schema}, lambda t, s=schema: validates(s, t)))
        elif name == "regex":
            question = f"Generate an email address for Alan Turing, who works in Enigma ({rng.randint(1, 999)}). " \
                       f"End in .com and new line. Example result: alan.turing@enigma.com\n"
            out.append((question, {"regex": REGEX}, lambda t: re.fullmatch(REGEX, t) is not None))
        elif name == "choice":
            review = rng.choice(["I love this product!", "Terrible, it broke.", "Best purchase ever.",
                                 "Never again."])
            question = f"Classify this sentiment: {review}"
            out.append((question, {"choice": CHOICES}, lambda t: t in CHOICES))
        else:
            raise ValueError(f"unknown structured dataset {name!r}: use json, json-unique, regex or choice")
    return out
