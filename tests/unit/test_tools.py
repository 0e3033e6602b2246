"""OpenAI tool calling on the router (``router/tools``, ``cluster/shared/chat_template.py``).

Rendering is checked as exact prompt text (the built-in Hermes block on a
ChatML template, and a tiny Jinja template that takes ``tools``); the
constraints as exact ``structured_outputs``; the parsers on tricky outputs
as exact content and calls; and every output cut at every point (and one
character at a time) must stream to exactly the calls of the whole text.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from cluster.shared.chat_template import TOOLS_FOOTER, TOOLS_HEADER, ChatTemplate
from cluster.shared.structured import StructuredOutputsParams
from cluster.shared.types import SamplingParams
from router.tools import (
    ToolError,
    apply_tool_constraint,
    assemble,
    make_parser,
    new_call_id,
    parse_tool_output,
    parse_tool_plan,
    resolve_parser,
    tool_constraint,
    tool_finish_reason,
)

# SmolLM2-135M-Instruct's template (the default model): ChatML, no tools.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A template that takes tools and tool calls, as Qwen2.5's does, in a few lines.
TOOL_TEMPLATE = (
    "{% if tools %}[TOOLS]{% for t in tools %}{{ t | tojson }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[CALL {{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}]"
    "{% endfor %}{% if m.tool_call_id %}[RESULT OF {{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
LLAMA3_LIKE = "{{ '<|start_header_id|>' }}{% if tools %}{{ tools | tojson }}{% endif %}{{ '<|eot_id|>' }}"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get-time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]


def plan_of(**body):
    return parse_tool_plan({"tools": TOOLS, **body})


def counter_ids():
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


def whole(plan, text):
    out = parse_tool_output(plan, text, counter_ids())
    return out.content, [(c.name, c.arguments) for c in out.tool_calls]


# --------------------------------------------------------------------------- rendering


HISTORY = [
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get-time", "arguments": "{}"}}]},
    {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
    {"role": "tool", "content": "12:00", "tool_call_id": "call_2"},
]


def test_builtin_block_is_its_own_system_message_and_history_is_hermes():
    text = ChatTemplate(CHATML).render(HISTORY, tools=TOOLS)
    block = TOOLS_HEADER + "\n" + json.dumps(WEATHER) + "\n" + json.dumps(TIME) + TOOLS_FOOTER
    assert text == (
        "<|im_start|>system\n" + block + "<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and the time?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get-time", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n12:00\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "Qwen" not in block and "<tool_call>\n{\"name\": <function-name>" in block


def test_builtin_block_merges_into_the_system_message():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": "Let me check.",
                                                              "tool_calls": HISTORY[1]["tool_calls"][:1]}]
    text = ChatTemplate(CHATML).render(messages, add_generation_prompt=False, tools=[TIME])
    assert text == (
        "<|im_start|>system\nBe brief.\n\n" + TOOLS_HEADER + "\n" + json.dumps(TIME) + TOOLS_FOOTER + "<|im_end|>\n"
        "<|im_start|>assistant\nLet me check.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
    )
    # Without tools nothing is added (the default model's prompt is unchanged).
    plain = ChatTemplate(CHATML).render(messages[:1])
    assert plain == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n"


def test_template_that_takes_tools_gets_them_and_the_calls():
    template = ChatTemplate(TOOL_TEMPLATE)
    assert template.takes_tools and not ChatTemplate(CHATML).takes_tools
    text = template.render(HISTORY, tools=TOOLS)
    assert text == (
        # key order kept, no HTML escapes; trim_blocks eats the newline after each block tag
        "[TOOLS]" + json.dumps(WEATHER) + ";" + json.dumps(TIME) + ";"
        "<user>Weather in Paris and the time?"
        '<assistant>[CALL call_1 get_weather {"city": "Paris"}][CALL call_2 get-time {}]'
        "<tool>18 C[RESULT OF call_1]<tool>12:00[RESULT OF call_2]<assistant>"
    )
    assert TOOLS_HEADER not in text


def test_resolve_parser_follows_the_template():
    assert resolve_parser("auto", LLAMA3_LIKE) == "llama3_json"
    assert resolve_parser("auto", CHATML) == "hermes"
    assert resolve_parser("auto", None) == "hermes"
    assert resolve_parser("llama3_json", CHATML) == "llama3_json"
    with pytest.raises(ValueError, match="tool_call_parser"):
        resolve_parser("mistral", CHATML)


# --------------------------------------------------------------------------- validation


def test_plan_defaults():
    plan = plan_of()
    assert (plan.choice, plan.function_name, plan.parallel, plan.parser) == ("auto", None, True, "hermes")
    assert [t.name for t in plan.tools] == ["get_weather", "get-time"]
    assert parse_tool_plan({}) is None and parse_tool_plan({"tool_choice": "none"}) is None
    named = plan_of(tool_choice={"type": "function", "function": {"name": "get-time"}}, parallel_tool_calls=False)
    assert (named.choice, named.function_name, named.parallel) == ("function", "get-time", False)
    bare = parse_tool_plan({"tools": [{"type": "function", "function": {"name": "ping"}}]})
    assert bare.prompt_tools() == [{"type": "function", "function": {
        "name": "ping", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("body, param, words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "must be one of"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools", "must match"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools",
     "schema of an object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools", "schema"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools", "only function tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools", "strict"),
    ({"tools": [{"type": "function", "function": {"name": "f", "args": {}}}]}, "tools", "unknown keys"),
    ({"tools": {"name": "f"}}, "tools", "must be a list"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", "true or false"),
    ({"functions": [{"name": "f"}]}, "functions", "deprecated"),
    ({"function_call": "auto"}, "function_call", "tools="),
])
def test_bad_tool_fields_name_the_param(body, param, words):
    with pytest.raises(ToolError) as info:
        parse_tool_plan(body)
    assert info.value.param == param and words in str(info.value)


# --------------------------------------------------------------------------- constraints


def test_constraint_of_each_tool_choice():
    assert tool_constraint(plan_of()) is None
    assert tool_constraint(plan_of(tool_choice="none")) is None
    named = tool_constraint(plan_of(tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert named == StructuredOutputsParams(json=WEATHER["function"]["parameters"])
    item = lambda t: {"type": "object", "properties": {"name": {"const": t["function"]["name"]},  # noqa: E731
                                                       "parameters": t["function"]["parameters"]},
                      "required": ["name", "parameters"], "additionalProperties": False}
    required = tool_constraint(plan_of(tool_choice="required"))
    assert required.schema() == {"type": "array", "minItems": 1, "items": {"anyOf": [item(WEATHER), item(TIME)]}}
    single = tool_constraint(plan_of(tool_choice="required", parallel_tool_calls=False))
    assert single.schema()["maxItems"] == 1


def test_strict_tool_in_auto_mode_gets_a_structural_tag():
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    plan = parse_tool_plan({"tools": [strict, TIME]})
    tag = json.loads(tool_constraint(plan).structural_tag)
    assert tag == {"type": "structural_tag", "triggers": ["<tool_call>"], "structures": [
        {"begin": '<tool_call>\n{"name": "get_weather", "arguments": ', "schema": WEATHER["function"]["parameters"],
         "end": "}\n</tool_call>"},
        {"begin": '<tool_call>\n{"name": "get-time", "arguments": ', "schema": TIME["function"]["parameters"],
         "end": "}\n</tool_call>"}]}
    llama = json.loads(tool_constraint(dataclasses.replace(plan, parser="llama3_json")).structural_tag)
    assert llama["triggers"] == ['{"name": ']
    assert llama["structures"][1]["begin"] == '{"name": "get-time", "parameters": '


def test_tool_constraint_conflicts_with_response_format():
    params = SamplingParams(max_tokens=8)
    plan = plan_of(tool_choice="required")
    assert apply_tool_constraint(params, plan).structured_outputs == tool_constraint(plan)
    assert apply_tool_constraint(params, plan_of()) is params
    constrained = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json_object=True))
    assert apply_tool_constraint(constrained, plan_of()) is constrained  # auto without strict tools: no conflict
    with pytest.raises(ToolError) as info:
        apply_tool_constraint(constrained, plan)
    assert info.value.param == "tool_choice" and "response_format" in str(info.value)


# --------------------------------------------------------------------------- parsers

CALL_W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_T = '<tool_call>\n{"name": "get-time", "arguments": {}}\n</tool_call>'
HERMES_CASES = [
    # (output, content, calls)
    ("Just text, no call.  ", "Just text, no call.  ", []),
    ("Sure!\n\n" + CALL_W, "Sure!", [("get_weather", '{"city": "Paris"}')]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "a</tool_call>b}"}}\n</tool_call>', None,
     [("get_weather", '{"city": "a</tool_call>b}"}')]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}}\n</tool_call>\n' + CALL_T, None,
     [("get_weather", '{"city": "Rome"}'), ("get-time", "{}")]),  # "Extra data": one brace too many
    (CALL_W + "\n" + CALL_T + "\n", None, [("get_weather", '{"city": "Paris"}'), ("get-time", "{}")]),
    (CALL_W + '\n<tool_call>\n{"name": "get-time", "arguments": {"tz": "U', '<tool_call>\n{"name": "get-time", '
     '"arguments": {"tz": "U', [("get_weather", '{"city": "Paris"}')]),  # cut by max_tokens
    ("<tool_call>\nnot json\n</tool_call> then " + CALL_T + " done", "<tool_call>\nnot json\n</tool_call> then done",
     [("get-time", "{}")]),
    ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>', []),  # not an offered tool
    ('<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_', None,
     [("get_weather", '{"city": "Oslo"}')]),  # arguments as JSON text; closing tag cut
    ('<tool_call>{"name": "get-time", "arguments": {}}\n{"name": "get_weather", "arguments": {"city": "Bern"}}'
     "</tool_call>", None, [("get-time", "{}"), ("get_weather", '{"city": "Bern"}')]),  # two objects, one tag
    ("Checking <tool_ca", "Checking <tool_ca", []),
]


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes_parser_on_tricky_outputs(text, content, calls):
    assert whole(plan_of(), text) == (content, calls)


def test_parallel_tool_calls_false_keeps_the_first_call():
    assert whole(plan_of(parallel_tool_calls=False), CALL_W + "\n" + CALL_T) == (None, [("get_weather",
                                                                                          '{"city": "Paris"}')])


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "}"}}; {"name": "get-time", "parameters": {}}', None,
     [("get_weather", '{"city": "}"}'), ("get-time", "{}")]),
    ('<|python_tag|>{"name": "get-time", "parameters": {}}', None, [("get-time", "{}")]),
    ('The answer is {"name": "get-time"}', 'The answer is {"name": "get-time"}', []),
    ('{"name": "get-time", "parameters": {}}; {"name": "get_weather", "para', '{"name": "get_weather", "para',
     [("get-time", "{}")]),
]


@pytest.mark.parametrize("text, content, calls", LLAMA_CASES)
def test_llama3_json_parser(text, content, calls):
    assert whole(dataclasses.replace(plan_of(), parser="llama3_json"), text) == (content, calls)


REQUIRED_CASES = [
    ('[{"name": "get-time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "]"}}]', None,
     [("get-time", "{}"), ("get_weather", '{"city": "]"}')]),
    ('[{"name": "get-time", "parameters": {}}, {"name": "get_weather", "parameters": {"ci',
     '{"name": "get_weather", "parameters": {"ci', [("get-time", "{}")]),
]


@pytest.mark.parametrize("text, content, calls", REQUIRED_CASES)
def test_required_parser(text, content, calls):
    assert whole(plan_of(tool_choice="required"), text) == (content, calls)


def test_named_parser_streams_the_output_as_arguments():
    plan = plan_of(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    parser = make_parser(plan, counter_ids())
    pieces = [parser.feed(p) for p in ['{"ci', 'ty": ', '"Paris"}']] + [parser.finish()]
    assert [[d.body() for d in p.tool_calls] for p in pieces] == [
        [{"index": 0, "id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"ci'}}],
        [{"index": 0, "function": {"arguments": 'ty": '}}],
        [{"index": 0, "function": {"arguments": '"Paris"}'}}],
        [],
    ]
    assert whole(plan, '{"city": "Paris"}') == (None, [("get_weather", '{"city": "Paris"}')])
    assert tool_finish_reason("stop", 1) == "tool_calls" and tool_finish_reason("length", 1) == "length"
    assert tool_finish_reason("stop", 0) == "stop"


def test_no_parser_for_tool_choice_none():
    assert make_parser(plan_of(tool_choice="none")) is None and parse_tool_output(None, "x") is None


def test_call_ids_are_openai_shaped():
    ids = {new_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(i.startswith("call_") and len(i) == 29 and i[5:].isalnum() for i in ids)


# --------------------------------------------------------------------------- streaming == whole

STREAM_CASES = (
    [(plan_of(), text) for text, _, _ in HERMES_CASES]
    + [(dataclasses.replace(plan_of(), parser="llama3_json"), text) for text, _, _ in LLAMA_CASES]
    + [(plan_of(tool_choice="required"), text) for text, _, _ in REQUIRED_CASES]
    + [(plan_of(tool_choice={"type": "function", "function": {"name": "get_weather"}}), '{"city": "Paris"}')]
)


def _streamed(plan, pieces):
    parser = make_parser(plan, counter_ids())
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    for delta in deltas:  # a call's first delta names it, later ones carry arguments only
        for piece in delta.tool_calls:
            assert (piece.id is None) == (piece.name is None)
    return assemble(deltas)


@pytest.mark.parametrize("index", range(len(STREAM_CASES)))
def test_streamed_calls_assemble_to_the_whole_answer(index):
    plan, text = STREAM_CASES[index]
    expected = parse_tool_output(plan, text, counter_ids())
    assert _streamed(plan, list(text)) == expected  # one character at a time
    for cut in range(len(text) + 1):
        for cut2 in range(cut, len(text) + 1, 7):
            assert _streamed(plan, [text[:cut], text[cut:cut2], text[cut2:]]) == expected, (cut, cut2)


def test_a_constrained_tool_schema_the_engine_cannot_enforce_is_refused_naming_the_tool():
    from cluster.shared.types import SamplingParams
    from router.tools.constraints import apply_tool_constraint
    from router.tools.plan import ToolError, parse_tool_plan

    unique = {"type": "object", "properties": {"t": {"type": "array", "items": {"type": "string"},
                                                     "uniqueItems": True}}}
    tools = [{"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "f", "parameters": unique}}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(ToolError, match=r"tools\[1\]\.function\.parameters uses uniqueItems") as err:
            apply_tool_constraint(SamplingParams(), parse_tool_plan({"tools": tools, "tool_choice": choice}))
        assert err.value.param == "tools"
    # Shown in the prompt only (auto, not strict) or another tool named: nothing to enforce, no error.
    assert apply_tool_constraint(SamplingParams(), parse_tool_plan({"tools": tools})).structured_outputs is None
    named = {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "ok"}}}
    assert apply_tool_constraint(SamplingParams(), parse_tool_plan(named)).structured_outputs is not None
