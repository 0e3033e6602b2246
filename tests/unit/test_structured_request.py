"""Output constraints of a request: OpenAI's ``response_format``, vLLM's ``structured_outputs`` and
``guided_*``, over HTTP (``router.openai.protocol.parse_request`` and the official client) and gRPC
(``router.convert``). Each maps to one exact ``StructuredOutputsParams`` or a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import AsyncIterator, Optional

import openai
import pydantic
import pytest

from cluster.shared.structured import StructuredOutputsParams as SOP
from cluster.shared.types import FinishReason, GenerationRequest, SamplingParams, StreamChunk
from router.backend import ModelInfo
from router.convert import request_from_proto, request_to_proto, sampling_params_from_proto, sampling_params_to_proto
from router.openai.protocol import APIError, parse_request
from router.pb import generation_pb2 as pb
from tests.factories import make_router_tokenizer
from tests.unit.http_api.openai_server import serving

MODEL = ModelInfo("tiny-llama", 256)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
UNIQUE = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}


@pytest.fixture(scope="module")
def router_tok(tmp_path_factory):
    return make_router_tokenizer(tmp_path_factory.mktemp("tiny-tok"))


def parse(router_tok, chat: bool = True, **fields) -> Optional[SOP]:
    body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    return parse_request({**body, "max_tokens": 4, **fields}, chat, router_tok, MODEL).request \
        .sampling_params.structured_outputs


def refused(router_tok, chat: bool = True, **fields) -> APIError:
    with pytest.raises(APIError) as info:
        parse(router_tok, chat, **fields)
    assert info.value.status == 400 and info.value.type == "invalid_request_error"
    return info.value


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, SOP(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "A", "schema": SCHEMA, "strict": True,
                                                                 "description": "d"}}}, SOP(json=SCHEMA)),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": False}}},
     SOP(json=SCHEMA)),
    ({"structured_outputs": {"regex": "[a-z]+", "whitespace_limit": 4}}, SOP(regex="[a-z]+", whitespace_limit=4)),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, SOP(choice=("yes", "no"))),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     SOP(json=SCHEMA, disable_any_whitespace=True)),
    ({"guided_json": SCHEMA}, SOP(json=SCHEMA)),
    ({"guided_json": json.dumps(SCHEMA)}, SOP(json=json.dumps(SCHEMA))),  # JSON text kept as sent
    ({"guided_regex": "\\d+"}, SOP(regex="\\d+")),
    ({"guided_choice": ["a", "b"], "guided_decoding_backend": "xgrammar"}, SOP(choice=("a", "b"))),
    ({"guided_grammar": 'root ::= "a"', "guided_decoding_backend": "auto"}, SOP(grammar='root ::= "a"')),
    # A structured_outputs object with only whitespace knobs joins the other source, as in vLLM.
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"disable_any_whitespace": True}},
     SOP(json_object=True, disable_any_whitespace=True)),
    ({"guided_regex": "a", "structured_outputs": {"whitespace_limit": 2}}, SOP(regex="a", whitespace_limit=2)),
    ({"response_format": {"type": "text"}, "guided_regex": "a"}, SOP(regex="a")),
])
def test_constraint_sources_map_to_params(router_tok, chat, fields, expected):
    assert parse(router_tok, chat, **fields) == expected


def test_structural_tag_response_format_is_passed_whole_as_vllm_does(router_tok):
    fmt = {"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}
    assert parse(router_tok, response_format=fmt) == SOP(structural_tag=fmt)


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": "json"}, "response_format", "must be an object with a type"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type 'xml' is not supported"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "response_format.json_schema must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "A"}}}, "response_format",
     "response_format.json_schema.schema is required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "{}"}}}, "response_format",
     "response_format.json_schema.schema must be a JSON schema object, got str"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}},
     "response_format", "response_format.json_schema.strict must be true or false"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "name": 3}}},
     "response_format", "response_format.json_schema.name must be a string"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, "schma": {}}}},
     "response_format", "does not take schma"),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "response_format",
     "response_format of type json_object does not take schema: remove it"),
    ({"structured_outputs": "json"}, "structured_outputs", "structured_outputs must be an object"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"jsn": SCHEMA}}, "structured_outputs", "unknown structured_outputs key 'jsn'"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs", "only whitespace options"),
    ({"guided_json": 5}, "guided_json", "guided_json must be a JSON schema"),
    ({"guided_json": "{not json"}, "guided_json", "guided_json is not valid JSON"),
    ({"guided_regex": ""}, "guided_regex", "guided_regex must be a non-empty string"),
    ({"guided_choice": "yes"}, "guided_choice", "guided_choice must be a list of strings"),
    ({"guided_choice": []}, "guided_choice", "guided_choice must hold 1 to"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "not supported"),
    ({"guided_regex": "a", "structured_outputs": {"whitespace_limit": 999}}, "structured_outputs",
     "whitespace_limit"),
])
def test_malformed_constraints_get_400_naming_the_field(router_tok, fields, param, words):
    err = refused(router_tok, **fields)
    assert err.param == param and words in err.message, err.message


@pytest.mark.parametrize("fields, param, dropped", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "guided_regex": "a"},
     "guided_regex",
     "response_format and guided_regex each constrain the output: send one of them (drop guided_regex)"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "drop structured_outputs"),
    ({"structured_outputs": {"choice": ["a"]}, "guided_json": SCHEMA}, "guided_json", "drop guided_json"),
    ({"guided_json": SCHEMA, "guided_regex": "a", "guided_choice": ["b"]}, "guided_regex",
     "drop guided_regex, guided_choice"),
])
def test_two_constraint_sources_get_400_saying_which_to_drop(router_tok, fields, param, dropped):
    err = refused(router_tok, **fields)
    assert err.param == param and dropped in err.message, err.message


def test_invalid_schema_gets_400_with_the_validators_message(router_tok):
    bad = {"type": "object", "properties": {"a": {"type": "strin"}}}
    err = refused(router_tok, response_format={"type": "json_schema", "json_schema": {"schema": bad}})
    assert err.param == "response_format"
    assert err.message.startswith("response_format.json_schema.schema is not a valid JSON Schema (draft 2020-12): "
                                  "'strin' is not valid under any of the given schemas at $.properties.a.type")
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "string", "minLength": -1}
    err = refused(router_tok, False, guided_json=draft7)
    assert err.param == "guided_json" and "guided_json is not a valid JSON Schema (draft 7): -1" in err.message


@pytest.mark.parametrize("field, value, param, where", [
    ("response_format", {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
        "tags": UNIQUE}}}}, "response_format", "response_format.json_schema.schema"),
    ("structured_outputs", {"json": UNIQUE}, "structured_outputs", "structured_outputs"),
    ("guided_json", UNIQUE, "guided_json", "guided_json"),
])
def test_unenforceable_schema_features_get_400_naming_them(router_tok, field, value, param, where):
    err = refused(router_tok, **{field: value})
    at = "$.properties.tags" if field == "response_format" else "$"
    assert err.param == param
    assert err.message == f"{where} uses uniqueItems at {at}, which structured outputs cannot enforce: remove it " \
                          "from the schema"


def test_many_unenforceable_features_are_counted(router_tok):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer", "not": {"const": i}} for i in range(10)}}
    err = refused(router_tok, guided_json=schema)
    assert "not at $.properties.p7 and 2 more, which" in err.message and "p8" not in err.message


def test_regexes_are_left_to_the_engine(router_tok):
    # Python's re has no \p{...}; xgrammar's dialect may: the router must not judge either.
    assert parse(router_tok, guided_regex="\\p{L}+") == SOP(regex="\\p{L}+")
    schema = {"type": "string", "pattern": "\\p{L}+"}
    assert parse(router_tok, structured_outputs={"json": schema}) == SOP(json=schema)


# --- gRPC -------------------------------------------------------------------------------------


@pytest.mark.parametrize("so", [
    SOP(json=SCHEMA), SOP(json_object=True, disable_any_whitespace=True), SOP(regex="a+", whitespace_limit=3),
    SOP(choice=("x", "y")), SOP(grammar='root ::= "a"'), SOP(structural_tag={"type": "structural_tag", "format": {}}),
])
def test_proto_round_trip(router_tok, so):
    params = SamplingParams(max_tokens=5, structured_outputs=so)
    wire = pb.SamplingParams.FromString(sampling_params_to_proto(params).SerializeToString())
    assert sampling_params_from_proto(wire) == params
    request = GenerationRequest("r1", [1, 2, 3], params)
    assert request_from_proto(request_to_proto(request), router_tok).sampling_params == params


def test_proto_without_constraint_stays_unconstrained():
    msg = sampling_params_to_proto(SamplingParams())
    assert not msg.HasField("structured_outputs") and sampling_params_from_proto(msg).structured_outputs is None


@pytest.mark.parametrize("so, words", [
    (pb.StructuredOutputs(), "sampling.structured_outputs sets no constraint: set one of json_schema, json_object"),
    (pb.StructuredOutputs(json_object=False), "sampling.structured_outputs.json_object must be true when set"),
    (pb.StructuredOutputs(json_schema="[1"), "sampling.structured_outputs.json_schema is not valid JSON"),
    (pb.StructuredOutputs(json_schema='{"type": 5}'),
     "sampling.structured_outputs.json_schema is not a valid JSON Schema (draft 2020-12): 5 is not valid"),
    (pb.StructuredOutputs(json_schema=json.dumps(UNIQUE)),
     "sampling.structured_outputs.json_schema uses uniqueItems at $, which structured outputs cannot enforce"),
    (pb.StructuredOutputs(choice=pb.ChoiceList()), "sampling.structured_outputs.choice must hold 1 to"),
    (pb.StructuredOutputs(regex="a", whitespace_limit=999), "sampling.structured_outputs.whitespace_limit"),
])
def test_proto_errors_name_the_field(so, words):
    with pytest.raises(ValueError) as info:
        sampling_params_from_proto(pb.SamplingParams(structured_outputs=so))
    assert str(info.value).startswith(words), str(info.value)


# --- the official client ------------------------------------------------------------------------


class Answer(pydantic.BaseModel):
    city: str
    population: Optional[int]


class JsonBackend:
    """Streams one chunk holding ``text`` and records the requests."""

    def __init__(self, tokenizer, text: str) -> None:
        self.tokenizer = tokenizer
        self.model = MODEL
        self.text = text
        self.requests: list[GenerationRequest] = []

    async def stream(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        self.requests.append(request)
        yield StreamChunk(request_id=request.request_id, token_ids=[5], text=self.text,
                          finish_reason=FinishReason.STOP, prompt_tokens=len(request.prompt_token_ids),
                          completion_tokens=1, replica_id="replica-0")


@pytest.fixture(scope="module")
def served(router_tok):
    backend = JsonBackend(router_tok, '{"city": "Oslo", "population": 700000}')
    with serving(backend) as handle:
        yield backend, handle


def test_openai_parse_sends_the_strict_schema_the_engine_gets(served):
    from openai.lib._pydantic import to_strict_json_schema

    backend, handle = served
    with openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0, timeout=20) as client:
        done = client.chat.completions.parse(model=MODEL.name, messages=[{"role": "user", "content": "Oslo?"}],
                                             response_format=Answer, max_completion_tokens=8)
        assert done.choices[0].message.parsed == Answer(city="Oslo", population=700000)
        assert backend.requests[-1].sampling_params.structured_outputs == SOP(json=to_strict_json_schema(Answer))
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL.name, messages=[{"role": "user", "content": "hi"}],
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "T", "schema": {"type": "object", "properties": {
                                                   "tags": UNIQUE}}}})
    assert info.value.status_code == 400
    error = info.value.response.json()["error"]
    assert error["param"] == "response_format" and "uniqueItems at $.properties.tags" in error["message"]
