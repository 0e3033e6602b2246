"""Structured outputs after a think block (``StructuredOutputsParams.reasoning``):
the grammar the engine compiles, walked token by token on the default model's
tokenizer, lets a think block through before the constraint and holds the
content after it, for every kind of constraint."""

from __future__ import annotations

import json

import pytest

from cluster.shared.structured import StructuredOutputsParams
from workers.model.loader import resolve_model
from workers.structured.xgrammar_backend import XGrammarBackend

EOS = 2
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
TOOL_TAG = {"type": "structural_tag", "triggers": ["<tool_call>"], "structures": [
    {"begin": '<tool_call>{"name": "f", "arguments": ', "schema": SCHEMA, "end": "}</tool_call>"}]}
KINDS = {
    "json": ({"json": SCHEMA}, '{"a": 1}', '{"b": 1}'),
    "json_object": ({"json_object": True}, '{"x": [1]}', "[1]"),
    "regex": ({"regex": "[0-9]{3}"}, "123", "12a"),
    "choice": ({"choice": ["yes", "no"]}, "no", "nope"),
    "grammar": ({"grammar": 'root ::= "A" | "BC"'}, "BC", "B"),
    "structural_tag": ({"structural_tag": TOOL_TAG}, '<tool_call>{"name": "f", "arguments": {"a": 2}}</tool_call>',
                       '<tool_call>{"name": "f", "arguments": {"b": 2}}</tool_call>'),
    "xgrammar_tag": ({"structural_tag": {"type": "structural_tag", "format": {"type": "const_string", "value": "ok"}}},
                     "ok", "ko"),
}
THOUGHT = "<think>\nThe user wants {\"a\": 1}; say 7 </thi not yet.\n</think>\n\n"


@pytest.fixture(scope="module")
def backend():
    made = XGrammarBackend(resolve_model(None) / "tokenizer.json", 49152, [EOS])
    yield made
    made.shutdown()


def _accepts(backend, params: StructuredOutputsParams, text: str) -> bool:
    """The grammar takes ``text`` as the model's tokens, then ends (EOS allowed)."""
    state = backend.new_state(params)
    ids = backend._encode(text)
    if not all(state.accept(token) for token in ids):
        return False
    masks = backend.allocate_masks(1)
    state.fill_mask(masks, 0)
    return bool((masks[0, EOS // 32] >> (EOS % 32)) & 1)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_constraint_holds_after_the_think_block(backend, kind):
    fields, good, bad = KINDS[kind]
    plain = StructuredOutputsParams(**fields)
    optional = StructuredOutputsParams(**fields, reasoning="optional")
    opened = StructuredOutputsParams(**fields, reasoning="open")
    free_text = kind == "structural_tag"  # a triggered tag: free text, calls constrained wherever they start
    assert _accepts(backend, plain, good) and not _accepts(backend, plain, bad)
    assert _accepts(backend, plain, THOUGHT + good) == free_text  # without it the block is refused
    # "optional": a whole block first, or none.
    assert _accepts(backend, optional, THOUGHT + good) and _accepts(backend, optional, good)
    assert not _accepts(backend, optional, THOUGHT + bad) and not _accepts(backend, optional, bad)
    assert _accepts(backend, optional, "Sure. " + good) == free_text  # only a think block may come first
    # "open": the prompt opened the block: the output must close it first.
    assert _accepts(backend, opened, THOUGHT[len("<think>"):] + good)
    assert not _accepts(backend, opened, good) and not _accepts(backend, opened, "thought</think>\n\n" + bad)


def test_a_call_written_inside_the_think_block_is_thought(backend):
    fields, good, bad = KINDS["structural_tag"]
    thought = "<think>Maybe " + bad + "?</think>\n\n"  # a malformed call, inside the block
    assert not _accepts(backend, StructuredOutputsParams(**fields), thought + good)
    assert _accepts(backend, StructuredOutputsParams(**fields, reasoning="optional"), thought + good)
    assert not _accepts(backend, StructuredOutputsParams(**fields, reasoning="optional"), thought + bad)


def test_the_block_ends_at_its_first_closing_tag_and_a_short_gap(backend):
    params = StructuredOutputsParams(json=SCHEMA, reasoning="optional")
    assert not _accepts(backend, params, "<think>a</think> b</think>" + '{"a": 1}')
    assert _accepts(backend, params, "<think>a</think>\n \n\t" + '{"a": 1}')  # 4 whitespace characters
    assert not _accepts(backend, params, "<think>a</think>\n\n\n\n\n" + '{"a": 1}')
    assert not _accepts(backend, params, "<think>unclosed " + '{"a": 1}')


def test_reasoning_is_part_of_the_cache_key_and_checked():
    keys = {StructuredOutputsParams(regex="a", reasoning=mode).cache_key for mode in (None, "optional", "open")}
    assert len(keys) == 3
    with pytest.raises(ValueError, match="structured_outputs.reasoning must be one of optional, open"):
        StructuredOutputsParams(regex="a", reasoning="always")
    with pytest.raises(ValueError, match="unknown structured_outputs key 'reasoning'"):
        StructuredOutputsParams.from_mapping({"regex": "a", "reasoning": "open"})  # the router's, not a client's
    assert json.loads(StructuredOutputsParams(json=SCHEMA, reasoning="open").json) == SCHEMA
