"""Reasoning split from content over HTTP (router/reasoning.py): chat completions
whole and streamed, tool calls after the think block, chat_template_kwargs, and
the Responses API's reasoning items; the fake backend streams a recorded-style
Qwen3 / DeepSeek-R1 output in pieces that cut the tags."""

from __future__ import annotations

import httpx2 as httpx
import openai
import pytest

from cluster.shared.types import FinishReason
from router.backend import ModelInfo
from router.openai.response_store import MemoryResponseStore
from tests.factories import make_router_tokenizer
from tests.unit.http_api.openai_server import MODEL, FakeBackend, serving

# Qwen3's generation prompt, reduced: enable_thinking false writes an empty think block.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
QWEN3 = ["<th", "ink>\nThe user", " says hi.\n</", "think>", "\n\nHello", "!"]
R1 = ["Let me", " see: 2 + 2 = 4.\n</thi", "nk>\n\n", "4"]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tokenizer = make_router_tokenizer(tmp_path_factory.mktemp("think-tok"), TEMPLATE)
    tokenizer.reasoning_parser = "auto"  # the template writes <think>: qwen3
    backend = FakeBackend(tokenizer)
    backend.model = ModelInfo(MODEL, 4096)
    backend.response_store = MemoryResponseStore()
    with serving(backend) as handle:
        yield backend, handle


@pytest.fixture()
def fake(served):
    backend, _ = served
    backend.fail, backend.delay, backend.fail_after = None, 0.0, None
    backend.script, backend.script_finish = QWEN3, FinishReason.STOP
    backend.requests.clear()
    backend.tokenizer.reasoning_parser = "auto"
    return backend


@pytest.fixture()
def api(served):
    _, handle = served
    with openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0, timeout=20) as client:
        yield client


def _streamed(api, **body):
    reasoning, reasoning_content, content, calls, reasons = [], [], [], [], []
    for chunk in api.chat.completions.create(model=MODEL, stream=True, **body):
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        reasoning.append(extra.get("reasoning") or "")
        reasoning_content.append(extra.get("reasoning_content") or "")
        content.append(delta.content or "")
        calls.extend(delta.tool_calls or [])
        reasons.append(chunk.choices[0].finish_reason)
    assert reasoning == reasoning_content  # the same text under both names
    return "".join(reasoning), "".join(content), calls, [r for r in reasons if r]


def test_chat_returns_the_reasoning_under_both_names(api, fake):
    message = api.chat.completions.create(model=MODEL, messages=HI).choices[0].message
    assert message.content == "Hello!"
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] == "The user says hi."


def test_a_streamed_chat_sends_reasoning_deltas_then_content(api, fake):
    assert _streamed(api, messages=HI) == ("The user says hi.", "Hello!", [], ["stop"])


def test_deepseek_r1_output_starts_in_reasoning(api, fake):
    fake.tokenizer.reasoning_parser = "deepseek_r1"
    fake.script = R1
    message = api.chat.completions.create(model=MODEL, messages=HI).choices[0].message
    assert (message.model_extra["reasoning"], message.content) == ("Let me see: 2 + 2 = 4.", "4")
    assert _streamed(api, messages=HI)[:2] == ("Let me see: 2 + 2 = 4.", "4")


def test_without_a_think_block_the_reasoning_is_none(api, fake):
    fake.script = ["Just", " an answer."]
    message = api.chat.completions.create(model=MODEL, messages=HI).choices[0].message
    assert message.content == "Just an answer." and message.model_extra["reasoning_content"] is None


def test_no_parser_leaves_the_think_block_in_the_content(api, fake):
    fake.tokenizer.reasoning_parser = "none"
    message = api.chat.completions.create(model=MODEL, messages=HI).choices[0].message
    assert message.content == "".join(QWEN3) and "reasoning" not in (message.model_extra or {})


def test_tool_calls_are_read_from_the_content_after_the_reasoning(api, fake):
    # A call written inside the think block is thought, not a call; the one after it is.
    fake.script = ["<think>\nMaybe ", CALL[:30], CALL[30:], "\n</think>\n\n", CALL[:25], CALL[25:]]
    choice = api.chat.completions.create(model=MODEL, messages=HI, tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert choice.message.model_extra["reasoning"] == "Maybe " + CALL
    reasoning, content, calls, reasons = _streamed(api, messages=HI, tools=[WEATHER])
    assert reasoning == "Maybe " + CALL and content == "" and reasons == ["tool_calls"]
    assert [c.function.name for c in calls if c.function.name] == ["get_weather"]


def test_a_grammar_holds_the_content_after_the_reasoning(api, fake):
    # deepseek_r1 starts in reasoning: the engine's grammar lets the block through before the JSON.
    fake.tokenizer.reasoning_parser = "deepseek_r1"
    fake.script = ["Some", " JSON.</think>", "\n\n", '{"a": ', '1}']
    message = api.chat.completions.create(model=MODEL, messages=HI,
                                          response_format={"type": "json_object"}).choices[0].message
    assert (message.model_extra["reasoning"], message.content) == ("Some JSON.", '{"a": 1}')
    assert fake.requests[-1].sampling_params.structured_outputs.reasoning == "open"
    # qwen3: a whole block may come first, or none; the Responses API's text.format too.
    fake.tokenizer.reasoning_parser = "qwen3"
    fake.script = ["<think>", "short</think>", "yes"]
    message = api.chat.completions.create(model=MODEL, messages=HI, extra_body={
        "structured_outputs": {"choice": ["yes", "no"]}}).choices[0].message
    assert (message.model_extra["reasoning"], message.content) == ("short", "yes")
    assert fake.requests[-1].sampling_params.structured_outputs.reasoning == "optional"
    api.responses.create(model=MODEL, input="hi", text={"format": {"type": "json_object"}})
    assert fake.requests[-1].sampling_params.structured_outputs.reasoning == "optional"
    # Tool constraints too (tool_choice required).
    fake.script = ["<think>", "call it</think>", CALL]
    choice = api.chat.completions.create(model=MODEL, messages=HI, tools=[WEATHER], tool_choice="required").choices[0]
    assert fake.requests[-1].sampling_params.structured_outputs.reasoning == "optional"
    assert choice.message.model_extra["reasoning"] == "call it"
    # A prompt that closed the block (enable_thinking false): the grammar holds from the first token.
    api.chat.completions.create(model=MODEL, messages=HI, response_format={"type": "json_object"},
                                extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert fake.requests[-1].sampling_params.structured_outputs.reasoning is None
    fake.tokenizer.reasoning_parser = "none"
    api.chat.completions.create(model=MODEL, messages=HI, response_format={"type": "json_object"})
    assert fake.requests[-1].sampling_params.structured_outputs.reasoning is None


def test_chat_template_kwargs_reach_the_template(api, fake):
    fake.script = ["Hello", "!"]
    message = api.chat.completions.create(model=MODEL, messages=HI,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}}
                                          ).choices[0].message
    prompt = fake.tokenizer.decode(fake.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert fake.requests[-1].prompt_token_ids == fake.tokenizer.render_chat(
        HI, template_kwargs={"enable_thinking": False})
    assert "</think>" in prompt.replace(" ", "")
    # The prompt closed the think block: the output is all content.
    assert message.content == "Hello!" and message.model_extra["reasoning"] is None


def test_a_prompt_that_opens_think_starts_in_reasoning(api, fake):
    fake.script = ["Thinking", " done.</think>", "Answer."]
    kept = fake.tokenizer.reasoning_mode
    fake.tokenizer.reasoning_mode = lambda text: kept(text + "<think>\n")
    try:
        message = api.chat.completions.create(model=MODEL, messages=HI).choices[0].message
    finally:
        del fake.tokenizer.reasoning_mode
    assert (message.model_extra["reasoning"], message.content) == ("Thinking done.", "Answer.")


@pytest.mark.parametrize("kwargs, param", [("nope", "chat_template_kwargs"),
                                           ({"messages": []}, "chat_template_kwargs")])
def test_bad_chat_template_kwargs_are_a_400(served, fake, kwargs, param):
    _, handle = served
    reply = httpx.post(f"{handle.url}/chat/completions", timeout=20,
                       json={"model": MODEL, "messages": HI, "chat_template_kwargs": kwargs})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param
    assert not fake.requests


def test_responses_put_a_reasoning_item_before_the_message(api, fake):
    response = api.responses.create(model=MODEL, input="hi")
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "The user says hi.")]
    assert message.type == "message" and response.output_text == "Hello!"
    fake.script = ["Again."]
    api.responses.create(model=MODEL, input="more", previous_response_id=response.id)
    prompt = fake.tokenizer.decode(fake.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert "Hello!" in prompt.replace(" ", "") and "says" not in prompt  # only the content is kept


def test_a_streamed_response_sends_reasoning_events_first(api, fake):
    events = list(api.responses.create(model=MODEL, input="hi", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.reasoning_text.delta"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    (done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert deltas == done.text == "The user says hi." and done.output_index == 0
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    text = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in text) == "Hello!" and {e.output_index for e in text} == {1}
    final = events[-1].response
    assert kinds[-1] == "response.completed" and [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].id == done.item_id and final.output_text == "Hello!"
    assert api.responses.retrieve(final.id).output[0].content[0].text == "The user says hi."


def test_a_streamed_response_that_only_thinks_closes_its_reasoning(api, fake):
    fake.script, fake.script_finish = ["<think>\nstill", " going"], FinishReason.LENGTH
    events = list(api.responses.create(model=MODEL, input="hi", stream=True))
    final = events[-1].response
    assert final.status == "incomplete" and final.output[0].content[0].text == "still going"
    assert [e.type for e in events].count("response.output_item.done") == 2  # reasoning, then the empty message


def test_usage_counts_the_reasoning_tokens(api, fake):
    # One token a piece: "<th", "ink>\nThe user", " says hi.\n</", "think>" are the think block's.
    usage = api.chat.completions.create(model=MODEL, messages=HI).usage
    assert usage.completion_tokens == 6 and usage.completion_tokens_details.reasoning_tokens == 4
    chunks = list(api.chat.completions.create(model=MODEL, messages=HI, stream=True,
                                              stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 4
    # The fake's second choice writes "<th/1": no think block there, so only the first one's count.
    usage = api.chat.completions.create(model=MODEL, messages=HI, n=2).usage
    assert usage.completion_tokens == 12 and usage.completion_tokens_details.reasoning_tokens == 4
    fake.script = ["<think>", "a", "</think>", "b"]  # "<think>/1", "a/1", "</think>/1": 3 each
    usage = api.chat.completions.create(model=MODEL, messages=HI, n=2).usage
    assert usage.completion_tokens_details.reasoning_tokens == 6
    fake.script = QWEN3
    response = api.responses.create(model=MODEL, input="hi")
    assert response.usage.output_tokens == 6 and response.usage.output_tokens_details.reasoning_tokens == 4
    events = list(api.responses.create(model=MODEL, input="hi", stream=True))
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == 4
    fake.tokenizer.reasoning_parser = "deepseek_r1"
    fake.script = R1
    assert api.chat.completions.create(model=MODEL, messages=HI).usage.completion_tokens_details.reasoning_tokens == 3
    assert api.responses.create(model=MODEL, input="hi").usage.output_tokens_details.reasoning_tokens == 3


def test_usage_without_a_think_block_or_a_parser(api, fake):
    fake.script = ["Just", " an answer."]
    assert api.chat.completions.create(model=MODEL, messages=HI).usage.completion_tokens_details.reasoning_tokens == 0
    fake.tokenizer.reasoning_parser = "none"
    fake.script = QWEN3
    assert api.chat.completions.create(model=MODEL, messages=HI).usage.completion_tokens_details is None
    assert api.responses.create(model=MODEL, input="hi").usage.output_tokens_details.reasoning_tokens == 0


def test_reasoning_effort_switches_thinking(api, fake):
    fake.script = ["Hello", "!"]
    message = api.chat.completions.create(model=MODEL, messages=HI, reasoning_effort="none").choices[0].message
    assert fake.requests[-1].prompt_token_ids == fake.tokenizer.render_chat(
        HI, template_kwargs={"enable_thinking": False})  # Qwen3's switch, as vLLM sets it
    assert message.content == "Hello!" and message.model_extra["reasoning"] is None
    api.chat.completions.create(model=MODEL, messages=HI, reasoning_effort="high")
    assert fake.requests[-1].prompt_token_ids == fake.tokenizer.render_chat(HI, template_kwargs={"enable_thinking": True})
    api.chat.completions.create(model=MODEL, messages=HI, reasoning_effort="minimal",
                                extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # the same: fine
    response = api.responses.create(model=MODEL, input="hi", reasoning={"effort": "none"})
    assert fake.requests[-1].prompt_token_ids == fake.tokenizer.render_chat(
        HI, template_kwargs={"enable_thinking": False})
    assert response.reasoning.effort == "none" and response.output_text == "Hello!"
    assert [item.type for item in response.output] == ["message"]


@pytest.mark.parametrize("path, body, param, words", [
    ("chat/completions", {"messages": HI, "reasoning_effort": "max"}, "reasoning_effort", "must be one of none"),
    ("chat/completions", {"messages": HI, "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
     "reasoning_effort", "send one of them"),
    ("responses", {"input": "hi", "reasoning": {"effort": "max"}}, "reasoning", "reasoning.effort must be one of"),
    ("responses", {"input": "hi", "reasoning": {"effort": "low", "summary": "auto"}}, "reasoning",
     "reasoning.summary: not supported"),
])
def test_reasoning_effort_we_cannot_honour_is_a_400(served, fake, path, body, param, words):
    _, handle = served
    reply = httpx.post(f"{handle.url}/{path}", timeout=20, json={"model": MODEL, **body})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param
    assert words in reply.json()["error"]["message"] and not fake.requests
