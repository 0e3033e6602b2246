"""``cluster.shared.schema_check``: every JSON Schema feature xgrammar 0.2.8 would drop is named with its path.

The verdicts come from compiling each schema with xgrammar and feeding it instances that violate
the keyword (the module's docstring has the table); these tests pin the rule, without xgrammar.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

import pydantic
import pytest

from cluster.shared.schema_check import unsupported_schema_features

OBJ = {"type": "object"}
MULTIPLE_OF = "multipleOf on a non-integer (only type integer with a whole value)"


def obj(**props) -> dict:
    return {"type": "object", "properties": props}


@pytest.mark.parametrize("schema", [
    {"type": "string"},
    {"type": ["string", "null"], "minLength": 1, "maxLength": 5},
    {"enum": ["a", 1, None]},
    {"type": "string", "enum": ["a", "b"]},
    {"const": {"a": 1}},
    {**obj(a={"type": "integer"}, b={"type": "string"}), "required": ["b"], "additionalProperties": False},
    {**obj(a={"type": "integer"}), "additionalProperties": {"type": "string"}},
    {"type": "object", "patternProperties": {"^x_.*$": {"type": "integer"}}, "additionalProperties": False},
    {"type": "object", "propertyNames": {"pattern": "^[a-c]+$"}},
    {"type": "object", "propertyNames": {"maxLength": 3}},
    {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1, "maxProperties": 3},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3, "uniqueItems": False},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
    {"items": {"type": "integer"}, "maxItems": 1},  # items implies an array (xgrammar infers it)
    {"properties": {"a": {"type": "integer"}}, "required": ["a"]},  # properties imply an object
    {"type": "string", "pattern": "^[0-9]{3}$"},
    {"type": "string", "format": "date-time"},
    {"type": "integer", "format": "int32"},  # a format on a non-string constrains nothing
    {"type": "integer", "minimum": 0, "exclusiveMaximum": 10, "multipleOf": 5},
    {"type": ["number", "null"], "minimum": -1.5, "maximum": 1e3},
    {"anyOf": [{"type": "integer"}, {"type": "null"}], "title": "N", "default": None, "description": "d"},
    {"allOf": [{"$ref": "#/$defs/n"}], "$defs": {"n": {"type": "integer"}}},
    {"$defs": {"n": {"type": "integer"}}, **obj(a={"$ref": "#/$defs/n", "description": "annotation only"})},
    {"definitions": {"n": {"type": "integer"}}, **obj(a={"$ref": "#/definitions/n"}, b={"$ref": "#/properties/a"})},
    {**obj(v={"type": "integer"}, next={"$ref": "#"})},  # recursive
    {**obj(a={"type": "integer"}), "unevaluatedProperties": False},
    {"oneOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]},  # disjoint types
    {"oneOf": [{"const": "a"}, {"enum": ["b", "c"]}]},  # disjoint values
    {"type": "string", "x-vendor": 1, "nullable": True, "examples": ["a"]},  # unknown keywords annotate
    True,
    {},
])
def test_enforced_schemas_have_no_problems(schema):
    assert unsupported_schema_features(schema) == []


@pytest.mark.parametrize("schema, problems", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, ["uniqueItems at $"]),
    ({"type": "array", "contains": {"const": 5}, "minContains": 2, "maxContains": 3},
     ["contains at $", "minContains at $", "maxContains at $"]),
    ({"type": "integer", "not": {"const": 3}}, ["not at $"]),
    ({"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 5}, "else": {"maximum": 9}},
     ["if at $", "then at $", "else at $"]),
    ({**obj(a=OBJ, b=OBJ), "dependentRequired": {"a": ["b"]}, "dependentSchemas": {"b": {"required": ["a"]}}},
     ["dependentRequired at $", "dependentSchemas at $"]),
    ({**obj(a=OBJ), "dependencies": {"a": ["b"]}}, ["dependencies at $"]),
    ({"type": "string", "contentEncoding": "base64"}, ["contentEncoding at $"]),
    ({"type": "string", "format": "idn-email"}, ["format 'idn-email' at $"]),
    ({"type": "string", "format": "password"}, ["format 'password' at $"]),
    ({"format": "date"}, ['format without "type": "string" at $']),
    ({"minLength": 2}, ['minLength without "type": "string" at $']),
    ({"pattern": "^a$"}, ['pattern without "type": "string" at $']),
    ({"minimum": 3}, ['minimum without "type": "number" at $']),
    ({"minItems": 1}, ['minItems without "type": "array" at $']),
    ({"minProperties": 1}, ['minProperties without "type": "object" at $']),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, ["maxLength beside pattern at $"]),
    ({"type": "string", "format": "uri", "minLength": 1}, ["minLength beside format at $"]),
    ({"type": "number", "multipleOf": 0.5}, [f"{MULTIPLE_OF} at $"]),
    ({"type": "integer", "multipleOf": 2.5}, [f"{MULTIPLE_OF} at $"]),
    ({"type": "integer", "anyOf": [{"minimum": 3}, {"type": "integer", "maximum": -3}]},
     ["type beside anyOf at $", 'minimum without "type": "number" at $.anyOf[0]']),
    ({"allOf": [{"type": "integer"}, {"type": "integer", "minimum": 3}]},
     ["allOf with 2 branches (merge them into one schema) at $"]),
    ({"allOf": [{"type": "integer"}], "maximum": 3}, ["maximum beside allOf at $"]),
    ({"$defs": {"n": {"type": "integer"}}, **obj(a={"$ref": "#/$defs/n", "minimum": 5})},
     ["minimum beside $ref at $.properties.a"]),
    ({"type": "string", "enum": ["a", "bb"], "minLength": 2}, ["minLength beside enum at $"]),
    ({"type": ["integer", "string"], "enum": [1, None]}, ["type beside enum at $"]),  # null would pass
    ({"type": "integer", "const": "a"}, ["type beside const at $"]),
    ({**obj(a={"type": "integer"}), "required": ["z"]}, ["required property 'z' that is not in properties at $"]),
    ({**obj(a={"$ref": "https://example.com/s.json"})},
     ["$ref 'https://example.com/s.json' (only local refs such as '#/$defs/Name' are resolved) at $.properties.a"]),
    ({"$defs": {"n": {"$anchor": "num", "type": "integer"}}, **obj(a={"$ref": "#num"})},
     ["$ref '#num' (only local refs such as '#/$defs/Name' are resolved) at $.properties.a"]),
    ({**obj(a={"$ref": "#/$defs/missing"})}, ["$ref '#/$defs/missing', which does not resolve in this schema at "
                                              "$.properties.a"]),
    ({**obj(a={"$dynamicRef": "#n"})}, ["$dynamicRef at $.properties.a"]),
    ({"type": "array", "items": [{"type": "integer"}], "additionalItems": False},
     ["additionalItems at $", "items as a list (draft 7 tuple: use prefixItems) at $"]),
    ({"type": "integer", "minimum": 3, "exclusiveMinimum": True},
     ["exclusiveMinimum as a boolean (draft 4: give the bound as a number) at $"]),
])
def test_dropped_features_are_named_with_their_path(schema, problems):
    assert unsupported_schema_features(schema) == problems


def test_nested_features_are_found_through_every_subschema():
    schema = {
        "$defs": {"Tag": obj(labels={"type": "array", "items": {"type": "string"}, "uniqueItems": True})},
        **obj(
            tags={"type": "array", "items": {"$ref": "#/$defs/Tag"}},
            pair={"type": "array", "prefixItems": [{"type": "integer"}, {"not": {"type": "null"}}]},
            either={"anyOf": [{"type": "string", "format": "iri"}, {"type": "null"}]},
            extra={"type": "object", "additionalProperties": {"type": "string", "format": "regex"}},
            names={"type": "object", "propertyNames": {"format": "byte"}},
            **{"odd key": {"type": "array", "contains": {"const": 1}}},
        ),
    }
    assert unsupported_schema_features(schema) == [
        "not at $.properties.pair.prefixItems[1]",
        "format 'iri' at $.properties.either.anyOf[0]",
        "format 'regex' at $.properties.extra.additionalProperties",
        "format 'byte' at $.properties.names.propertyNames",
        'contains at $.properties["odd key"]',
        "uniqueItems at $.$defs.Tag.properties.labels",
    ]


@pytest.mark.parametrize("branches, disjoint", [
    ([{"type": "integer"}, {"type": "number"}], False),  # 1 matches both
    ([{"type": "integer"}, {"type": ["string", "null"]}], True),
    ([{"const": "a"}, {"const": "a"}], False),
    ([{"enum": [1, 2]}, {"enum": [2.0, 3]}], False),  # 2 == 2.0 in JSON
    ([{"type": "string"}, {"type": "string", "maxLength": 3}], False),
    ([{**obj(k={"const": "a"}), "required": ["k"]}, {**obj(k={"enum": ["b", "c"]}), "required": ["k"]}], True),
    ([{**obj(k={"const": "a"}), "required": ["k"]}, obj(k={"const": "b"})], False),  # k optional in one
    ([{**obj(k={"const": "a"}), "required": ["k"]}, {**obj(k={"const": "a"}), "required": ["k"]}], False),
    ([{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}], True),  # followed through $ref
    ([{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/A"}], False),
    ([OBJ, {"type": "object"}], False),
])
def test_one_of_is_refused_unless_its_branches_are_provably_disjoint(branches, disjoint):
    schema = {"oneOf": branches, "$defs": {"A": {**obj(k={"const": "a", "type": "string"}), "required": ["k"]},
                                          "B": {**obj(k={"const": "b", "type": "string"}), "required": ["k"]}}}
    problem = ("oneOf with branches that may overlap (use anyOf, or give each branch a distinct const on a "
               "required property) at $")
    assert unsupported_schema_features(schema) == ([] if disjoint else [problem])


def test_what_the_openai_client_sends_for_a_pydantic_model_is_enforced():
    from openai.lib._parsing._completions import type_to_response_format_param

    class A(pydantic.BaseModel):
        kind: Literal["a"]
        x: int = pydantic.Field(ge=0, le=9)

    class B(pydantic.BaseModel):
        kind: Literal["b"]

    class Doc(pydantic.BaseModel):
        title: str = pydantic.Field(max_length=80)
        n: Optional[int]
        ab: Union[A, B] = pydantic.Field(discriminator="kind")
        color: Literal["r", "g"]
        child: Optional["Doc"]

    fmt = type_to_response_format_param(Doc)
    assert unsupported_schema_features(fmt["json_schema"]["schema"]) == []
    assert unsupported_schema_features(Doc.model_json_schema()) == []


def test_too_deep_a_schema_is_refused_not_recursed():
    schema: dict = {"type": "integer"}
    for _ in range(200):
        schema = {"type": "array", "items": schema}
    problems = unsupported_schema_features(schema)
    assert problems == ["nesting deeper than 128 levels at $" + ".items" * 129]
