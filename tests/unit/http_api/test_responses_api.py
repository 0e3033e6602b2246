"""/v1/responses through the official openai client, over the fake backend and an in-memory store."""

from __future__ import annotations

import asyncio

import httpx2 as httpx
import openai
import pytest

from cluster.shared.types import FinishReason
from router.openai.response_store import MemoryResponseStore, StoreUnavailable
from router.backend import ModelInfo
from tests.unit.http_api.openai_server import MODEL, FakeBackend, serving

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def served_responses(router_tok):
    backend = FakeBackend(router_tok)
    backend.model = ModelInfo(MODEL, 4096)  # room for the tools the chat template renders
    backend.response_store = MemoryResponseStore()
    with serving(backend) as handle:
        yield backend, handle


@pytest.fixture()
def fake(served_responses):
    backend, _ = served_responses
    backend.fail, backend.delay, backend.fail_after = None, 0.0, None
    backend.script, backend.script_finish = None, FinishReason.STOP
    backend.requests.clear()
    return backend


@pytest.fixture()
def api(served_responses):
    _, handle = served_responses
    with openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0, timeout=20) as client:
        yield client


def test_create_returns_the_text_usage_and_stops_at_max_output_tokens(api, fake):
    response = api.responses.create(model="tiny-llama", input="hello there", max_output_tokens=3)
    assert response.output_text == " w0 w1 w2" and response.object == "response"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    prompt_len = len(fake.requests[0].prompt_token_ids)
    assert response.usage.input_tokens == prompt_len and response.usage.output_tokens == 3
    assert response.usage.input_tokens_details.cached_tokens == ((prompt_len - 1) // 4) * 4
    assert fake.requests[0].sampling_params.max_tokens == 3


def test_a_stream_sends_the_events_in_order_and_its_deltas_make_the_text(api, fake):
    events = list(api.responses.create(model="tiny-llama", input="hello", max_output_tokens=4, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == " w0 w1 w2 w3"
    stored = api.responses.retrieve(final.id)
    assert stored.output_text == deltas


def test_a_continuation_carries_the_conversation_but_not_the_instructions(api, fake, router_tok):
    first = api.responses.create(model="tiny-llama", input="first question", instructions="be brief",
                                 max_output_tokens=2)
    second = api.responses.create(model="tiny-llama", input="second question", previous_response_id=first.id,
                                  max_output_tokens=2)
    p1, p2 = (router_tok.decode(r.prompt_token_ids, skip_special_tokens=False) for r in fake.requests)
    assert "be brief" in p1 and "be brief" not in p2
    assert "first question" in p2 and " w0 w1" in p2 and p2.index("first question") < p2.index("second question")
    assert second.usage.input_tokens >= first.usage.input_tokens - 5 + first.usage.output_tokens
    items = api.responses.input_items.list(second.id, order="asc").data
    assert [i.content[0].text for i in items] == ["second question"]


def test_retrieve_delete_and_unknown_ids(api, fake):
    response = api.responses.create(model="tiny-llama", input="keep me", max_output_tokens=1)
    assert api.responses.retrieve(response.id).id == response.id
    api.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.create(model="tiny-llama", input="x", previous_response_id="resp_nope")
    unstored = api.responses.create(model="tiny-llama", input="forget me", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(unstored.id)


def test_a_function_tool_round_trip(api, fake):
    fake.script = [CALL]
    call = api.responses.create(model="tiny-llama", input="Weather in Paris?", tools=[WEATHER])
    (item,) = call.output
    assert item.type == "function_call" and item.name == "get_weather" and '"Paris"' in item.arguments
    fake.script = [" It is sunny."]
    answer = api.responses.create(model="tiny-llama", previous_response_id=call.id, tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": item.call_id, "output": "sunny, 21 C"}])
    assert answer.output_text == " It is sunny."
    assert fake.requests[-1].prompt_token_ids[:len(fake.requests[0].prompt_token_ids) - 2] \
        == fake.requests[0].prompt_token_ids[:-2]  # the first turn's prompt, then the rest of the conversation


def test_a_streamed_call_comes_as_a_function_call_item(api, fake):
    fake.script = [CALL[:20], CALL[20:]]
    events = list(api.responses.create(model="tiny-llama", input="Weather?", tools=[WEATHER], stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and '"Paris"' in done[0].arguments
    assert events[-1].type == "response.completed" and events[-1].response.output[0].type == "function_call"
    assert not [e for e in events if e.type == "response.output_text.delta"]


@pytest.mark.parametrize("fields, message", [
    ({"tools": [{"type": "web_search"}]}, "only function tools are supported"),
    ({"reasoning": {"effort": "low"}}, "this model does not reason"),  # its template writes no think block
    ({"truncation": "auto"}, "truncation: 'auto' is not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "only text parts"),
])
def test_what_we_do_not_honour_is_a_400_naming_it(api, fake, fields, message):
    body = {"model": "tiny-llama", "input": "hi", **fields}
    with pytest.raises(openai.BadRequestError, match=message):
        api.responses.create(**body)
    assert not fake.requests


def test_an_unknown_field_is_named(served_responses, fake):
    _, handle = served_responses
    reply = httpx.post(f"{handle.url}/responses", json={"input": "hi", "prompt_cache_key": "k"}, timeout=20)
    assert reply.status_code == 400 and "'prompt_cache_key'" in reply.json()["error"]["message"]


def test_a_store_that_is_down_is_a_503_and_store_false_keeps_answering(served_responses, api, fake):
    backend, _ = served_responses

    class Down(MemoryResponseStore):
        async def put(self, *args):
            raise StoreUnavailable("the response store is unavailable: retry later, or send store: false")

        async def get(self, *args):
            raise StoreUnavailable("the response store is unavailable: retry later, or send store: false")

    kept, backend.response_store = backend.response_store, Down()
    try:
        with pytest.raises(openai.APIStatusError) as err:
            api.responses.create(model="tiny-llama", input="hi", max_output_tokens=1)
        assert err.value.status_code == 503 and "store: false" in err.value.message
        assert api.responses.create(model="tiny-llama", input="hi", max_output_tokens=1,
                                    store=False).output_text == " w0"
    finally:
        backend.response_store = kept


def test_the_memory_store_expires_records():
    now = [0.0]
    store = MemoryResponseStore(ttl_s=10, clock=lambda: now[0])

    async def main():
        await store.put("t", "r", {"a": 1})
        assert await store.get("t", "r") == {"a": 1} and await store.get("other", "r") is None
        now[0] = 11
        assert await store.get("t", "r") is None

    asyncio.run(main())


def _poll(api, response_id, timeout_s=20.0):
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        current = api.responses.retrieve(response_id)
        if current.status != "in_progress" or time.monotonic() > deadline:
            return current
        time.sleep(0.05)


def test_a_background_response_returns_at_once_and_completes_when_polled(api, fake):
    fake.delay = 0.05
    started = api.responses.create(model="tiny-llama", input="hello", max_output_tokens=3, background=True)
    assert started.status == "in_progress" and started.background is True and not started.output
    done = _poll(api, started.id)
    assert done.status == "incomplete" and done.output_text == " w0 w1 w2" and done.background is True


def test_cancelling_a_background_response_aborts_its_generation(api, fake):
    fake.delay = 0.1
    started = api.responses.create(model="tiny-llama", input="hello", max_output_tokens=200, background=True)
    cancelled = api.responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    assert fake.finalized_event.wait(10) and fake.requests[-1].request_id in fake.finalized
    assert api.responses.retrieve(started.id).status == "cancelled"


def test_a_background_response_whose_router_died_reads_as_failed(api, served_responses):
    backend, _ = served_responses
    record = {"response": {"id": "resp_orphan", "object": "response", "status": "in_progress", "background": True,
                           "output": [], "model": "tiny-llama", "created_at": 0},
              "input_items": [], "conversation": []}
    asyncio.run(backend.response_store.put("default", "resp_orphan", record))  # no lease: its router is gone
    failed = api.responses.retrieve("resp_orphan")
    assert failed.status == "failed" and "stopped before it finished" in failed.error.message


def test_a_cancel_sent_to_another_router_reaches_the_running_one(served_responses, router_tok, api, fake):
    backend, _ = served_responses
    other = FakeBackend(router_tok)
    other.model = backend.model
    other.response_store = backend.response_store  # one store, as two routers share Redis
    fake.delay = 0.1
    started = api.responses.create(model="tiny-llama", input="hello", max_output_tokens=200, background=True)
    with serving(other) as handle, openai.OpenAI(base_url=handle.url, api_key="unused", max_retries=0,
                                                 timeout=30) as second:
        assert second.responses.cancel(started.id).status == "cancelled"
    assert fake.finalized_event.wait(10)


@pytest.mark.parametrize("fields, message", [
    ({"background": True, "store": False}, "a background response is stored"),
    ({"background": True, "stream": True}, "streaming a background response is not supported"),
])
def test_background_needs_store_and_no_stream(api, fake, fields, message):
    with pytest.raises(openai.BadRequestError, match=message):
        api.responses.create(model="tiny-llama", input="hi", **fields)


def test_continued_turns_count_their_cached_share(api, fake):
    """router_continued_turn_*: the prompt and cached prompt tokens of turns that
    continue a stored response (plain and streamed), nothing for a first turn."""
    from router.metrics import RouterMetrics

    fake.metrics = metrics = RouterMetrics("prefix_cost")
    try:
        first = api.responses.create(model="tiny-llama", input="first question", max_output_tokens=2)
        second = api.responses.create(model="tiny-llama", input="second question", previous_response_id=first.id,
                                      max_output_tokens=2)
        events = list(api.responses.create(model="tiny-llama", input="third", previous_response_id=second.id,
                                           max_output_tokens=2, stream=True))
    finally:
        del fake.metrics
    third = events[-1].response.usage
    samples = {(s.name, tuple(s.labels.values())): s.value for m in metrics.registry.collect() for s in m.samples}
    turns = [second.usage, third]
    assert samples[("prefixserve:router_continued_turn_tokens_total", ("prompt",))] == \
        sum(u.input_tokens for u in turns)
    cached = sum(u.input_tokens_details.cached_tokens for u in turns)
    assert cached > 0 and samples[("prefixserve:router_continued_turn_tokens_total", ("cached_prompt",))] == cached
    assert samples[("prefixserve:router_continued_turn_cached_ratio_count", ())] == 2
