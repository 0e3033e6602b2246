"""Structured outputs and tool calling end to end: the official ``openai``
client against the real OpenAI HTTP server (and the gRPC router), a real
``RouterBackend``, one Ray Serve replica of the default model
(SmolLM2-135M-Instruct) and Redis.

The request surface beyond them (n, logit_bias, echo, a list of prompts)
runs on the same cluster, at the end.

What the engine enforces must reach a client as that client's library sees
it: ``chat.completions.parse`` gets a Pydantic object for every prompt,
every tool call's arguments validate against its tool's schema, a streamed
call assembles to the whole one, and a constraint the server cannot honour is
a 400 naming it that leaves the replica serving with no block held.
Without the constraint the model writes prose (tests/engine/
test_structured_outputs.py shows it): none of these would parse.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from cluster.app import build_app, model_info
from cluster.shared.config import ClusterConfig, EngineConfig
from cluster.shared.directory import Directory
from router.backend import ModelInfo, RouterBackend
from router.pb import generation_pb2 as pb
from router.pb import generation_pb2_grpc as pb_grpc
from router.tokenizer import RouterTokenizer
from tests.integration.structured_cases import MAX_TOKENS, SCHEMAS, SENTENCES, TOOL_PROMPTS, TOOLS, Person

APP = "structured"


# ------------------------------------------------------------------ cluster


@pytest.fixture(scope="module")
def cluster(ray_local, redis_server):
    """One replica of the default model; yields (handle, model_dir, model name, max_model_len, redis, namespace)."""
    from ray import serve

    namespace = f"so-{uuid.uuid4().hex[:6]}"
    engine = EngineConfig.from_kwargs(block_size=16, max_model_len=1024, num_kv_blocks=384, max_num_seqs=8)
    config = ClusterConfig(replicas=1, redis_url=redis_server.url, namespace=namespace, engine=engine,
                           replica_num_cpus=0.25)
    model_dir, name, max_len = model_info(config)  # engine.model None: the default model
    serve.start(proxy_location="Disabled")
    handle = serve.run(build_app(config), name=APP, route_prefix=None)
    try:
        yield handle, model_dir, name, max_len, redis_server.url, namespace
    finally:
        serve.delete(APP)


@pytest.fixture(scope="module")
def servers(cluster):
    """The gRPC router and the OpenAI HTTP server on their own thread's loop
    (as ``prefixserve up`` runs them); yields (grpc address, OpenAI base URL)."""
    from router.openai import serve_openai
    from router.server import RouterServer

    handle, model_dir, name, max_len, redis_url, namespace = cluster
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="structured-routers", daemon=True)
    thread.start()

    async def start():
        backend = RouterBackend(handle, RouterTokenizer.from_model_dir(model_dir), ModelInfo(name, max_len))
        server = RouterServer(backend, Directory.from_url(redis_url, namespace), port=0)
        await server.start()
        return server, await serve_openai(backend, port=0)

    server, http = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=60)
    try:
        yield server.address, http.url
    finally:
        asyncio.run_coroutine_threadsafe(http.stop(), loop).result(timeout=30)
        asyncio.run_coroutine_threadsafe(server.stop(grace=1.0), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def client(servers):
    with openai.OpenAI(base_url=servers[1], api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(cluster):
    return cluster[2]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def wait_idle_without_leak(handle: Any, timeout: float = 30.0) -> dict:
    """The replica's stats once nothing runs or waits; asserts every block is
    back: none in use (``kv_cache_usage`` 0), every one free, the cached ones
    among the free (the prefix cache keeps them, reusable, not held)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = handle.stats.remote().result(timeout_s=30)
        idle = stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_used_blocks"] == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, stats
    assert stats["kv_cache_usage"] == 0.0 and stats["num_swapped"] == 0, stats
    assert stats["num_free_blocks"] == stats["num_device_blocks"] == 384, stats
    assert stats["num_cached_blocks"] <= stats["num_free_blocks"], stats
    return stats


# ---------------------------------------------------------------- 1. parse


def test_parse_returns_a_pydantic_object_for_every_prompt(client, model):
    def extract(sentence: str):
        return client.chat.completions.parse(
            model=model, messages=user(f"Extract the person from this sentence as JSON: {sentence}"),
            response_format=Person, max_tokens=MAX_TOKENS, temperature=0)

    with ThreadPoolExecutor(8) as pool:
        completions = list(pool.map(extract, SENTENCES))
    assert len(completions) == len(SENTENCES) == 20
    for sentence, completion in zip(SENTENCES, completions):
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", (sentence, choice)
        assert isinstance(choice.message.parsed, Person), (sentence, choice.message.content)
        content = choice.message.content
        # Compact JSON, as the engine writes it by default (one space after ':' and ',').
        assert json.dumps(json.loads(content), ensure_ascii=False) == content
        assert choice.message.parsed == Person.model_validate_json(content)
        assert completion.usage.completion_tokens < MAX_TOKENS
    # A model answering unconstrained would not extract; this one did from most sentences.
    names = [c.choices[0].message.parsed.name for c in completions]
    assert sum(bool(n) and n.split()[0] in s for s, n in zip(SENTENCES, names)) >= 15, names


# ---------------------------------------------------------------- 2. tools


def call_of(message: Any) -> tuple[str, dict]:
    (call,) = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29, call
    return call.function.name, json.loads(call.function.arguments)


def streamed_calls(client: Any, model: str, **kwargs: Any) -> tuple[list[dict], str]:
    """The tool calls of a streamed answer, assembled by index; and its finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    content = []
    for chunk in client.chat.completions.create(model=model, stream=True, **kwargs):
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:  # the first delta of a call names it
                    assert delta.id and delta.function.name and delta.type == "function", delta
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                else:
                    assert delta.id is None and delta.function.name is None, delta
                calls[delta.index]["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert "".join(content) == "", content
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_calls_validate_and_stream_to_the_same_call(client, model, choice):
    def ask(prompt: str, **extra: Any):
        tool_choice = "required"
        if choice == "named":
            name = "convert_currency" if any(w in prompt for w in ("USD", "JPY", "euros")) else "get_weather"
            tool_choice = {"type": "function", "function": {"name": name}}
        kwargs = dict(messages=user(prompt), tools=TOOLS, tool_choice=tool_choice, max_tokens=MAX_TOKENS,
                      temperature=0, **extra)
        return kwargs, tool_choice

    def whole(prompt: str):
        kwargs, tool_choice = ask(prompt, parallel_tool_calls=False)
        return client.chat.completions.create(model=model, **kwargs), tool_choice

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(whole, TOOL_PROMPTS))
    for prompt, (completion, tool_choice) in zip(TOOL_PROMPTS, answers):
        c = completion.choices[0]
        assert c.finish_reason == "tool_calls", (prompt, c)
        assert c.message.content is None, (prompt, c.message)
        name, arguments = call_of(c.message)
        if isinstance(tool_choice, dict):
            assert name == tool_choice["function"]["name"]
        jsonschema.validate(arguments, SCHEMAS[name])
    # Streamed with temperature 0: the same call (name and arguments) as the whole answer.
    with ThreadPoolExecutor(6) as pool:
        streams = list(pool.map(lambda p: streamed_calls(client, model, **ask(p, parallel_tool_calls=False)[0]),
                                TOOL_PROMPTS))
    for (calls, finish), (completion, _) in zip(streams, answers):
        assert finish == "tool_calls"
        assert len(calls) == 1 and calls[0]["id"].startswith("call_")
        assert (calls[0]["name"], json.loads(calls[0]["arguments"])) == call_of(completion.choices[0].message)


def test_required_with_parallel_calls_each_validate(client, model):
    """tool_choice required with parallel calls allowed (the default): at least
    one call, every one of an offered tool with valid arguments."""
    completion = client.chat.completions.create(
        model=model, messages=user("What's the weather in Rome and in Madrid, in celsius?"), tools=TOOLS,
        tool_choice="required", max_tokens=2 * MAX_TOKENS, temperature=0)
    c = completion.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert len(c.message.tool_calls) >= 1
    assert len({call.id for call in c.message.tool_calls}) == len(c.message.tool_calls)
    for call in c.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# ----------------------------------------------------------- 3. bad input

BAD_REQUESTS = {
    "invalid schema": (
        dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
        ["response_format.json_schema.schema is not a valid JSON Schema", "nonsense"]),
    "regex does not compile": (
        dict(extra_body={"structured_outputs": {"regex": "[a-z"}}),
        ["structured_outputs.regex does not compile"]),
    "grammar does not compile": (
        dict(extra_body={"structured_outputs": {"grammar": 'root ::= "a" missing_rule'}}),
        ["structured_outputs.grammar does not compile"]),
    "unknown named tool": (
        dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "book_flight"}}),
        ["tool_choice names the function 'book_flight', which is not in tools (get_weather, convert_currency)"]),
    "required without tools": (dict(tool_choice="required"), ["tool_choice needs tools"]),
    "unenforced uniqueItems": (
        dict(response_format={"type": "json_schema", "json_schema": {"name": "tags", "schema": {
            "type": "array", "items": {"type": "string"}, "uniqueItems": True}}}),
        ["uniqueItems", "which structured outputs cannot enforce"]),
}

# The field at fault, where the router refuses (the engine's compile errors come back without one).
BAD_PARAMS = {"invalid schema": "response_format", "unknown named tool": "tool_choice",
              "required without tools": "tool_choice", "unenforced uniqueItems": "response_format"}


def test_bad_constraints_are_400s_and_leave_the_replica_clean(client, model, cluster):
    handle = cluster[0]
    for case, (kwargs, fragments) in BAD_REQUESTS.items():
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, messages=user("Say hi."), max_tokens=8, **kwargs)
        assert info.value.status_code == 400, case
        message = info.value.body["message"]
        assert all(f in message for f in fragments), (case, message)
        if case in BAD_PARAMS:
            assert info.value.body["param"] == BAD_PARAMS[case], (case, info.value.body)
    # The replica still serves, constrained and not, and holds nothing.
    ok = client.chat.completions.create(model=model, messages=user("Pick one."), max_tokens=8, temperature=0,
                                        extra_body={"structured_outputs": {"choice": ["red", "green"]}})
    assert ok.choices[0].message.content in ("red", "green") and ok.choices[0].finish_reason == "stop"
    assert client.chat.completions.create(model=model, messages=user("Say hi."), max_tokens=4).choices[0].message
    wait_idle_without_leak(handle)


# ------------------------------------------------------------------ 4. gRPC


def test_grpc_json_schema_matches_http_and_bad_regex_is_invalid_argument(client, model, servers):
    """The gRPC ``sampling.structured_outputs`` gives the HTTP API's greedy text for the same constraint."""
    schema = Person.model_json_schema()
    prompt = f"Extract the person from this sentence as JSON: {SENTENCES[0]}"
    http = client.chat.completions.create(
        model=model, messages=user(prompt), max_tokens=MAX_TOKENS, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "Person", "schema": schema}})

    def request(**structured: Any) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            messages=pb.ChatMessages(items=[pb.ChatMessage(role="user", content=prompt)]),
            sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                       structured_outputs=pb.StructuredOutputs(**structured)))

    async def main():
        async with grpc.aio.insecure_channel(servers[0]) as channel:
            stub = pb_grpc.GenerationStub(channel)
            chunks = [c async for c in stub.Generate(request(json_schema=json.dumps(schema)), timeout=120)]
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [c async for c in stub.Generate(request(regex="[a-z"), timeout=60)]
            return chunks, info.value

    chunks, error = asyncio.run(main())
    text = "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop"
    assert text == http.choices[0].message.content
    Person.model_validate_json(text)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_outputs.regex does not compile" in error.details()


# ------------------------------------------------ the rest of the request surface
# (n, logit_bias, echo, batched prompts on the same cluster: a second one would double its start-up)


def test_n_choices_through_the_openai_client_streamed_and_not(client, model, cluster):
    out = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, n=3,
                                    temperature=0.8, seed=5, logprobs=0)
    assert [c.index for c in out.choices] == [0, 1, 2] and all(c.text for c in out.choices)
    assert out.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in out.choices)  # one prompt, 3 choices
    singles = [client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                         temperature=0.8, seed=5 + i).choices[0].text for i in range(3)]
    assert [c.text for c in out.choices] == singles  # choice i is the request seeded with seed + i
    stream = client.chat.completions.create(model=model, messages=user("Name a color."), max_tokens=6, n=3,
                                            temperature=0.8, stream=True, stream_options={"include_usage": True})
    text: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            text[choice.index] = text.get(choice.index, "") + (choice.delta.content or "")
        usage = chunk.usage or usage
    assert sorted(text) == [0, 1, 2] and all(text.values())
    assert usage is not None and usage.completion_tokens > 6
    wait_idle_without_leak(cluster[0])


def test_logit_bias_bans_and_forces_a_token(client, model, cluster):
    tokenizer = RouterTokenizer.from_model_dir(cluster[1])
    prompt = "One, two, three, four,"
    greedy = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0.0, logprobs=0)
    word = greedy.choices[0].logprobs.tokens[0]  # the greedy first token, e.g. " five"
    (banned_id,) = tokenizer.encode(word, add_special_tokens=False)
    banned = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0.0, n=4, logprobs=0,
                                       logit_bias={str(banned_id): -100})
    for choice in banned.choices:
        assert word not in choice.logprobs.tokens
    forced_id = tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0.9, seed=2,
                                       logit_bias={str(forced_id): 100})
    assert tokenizer.encode(forced.choices[0].text, add_special_tokens=False) == [forced_id] * 4
    wait_idle_without_leak(cluster[0])


def test_echo_and_a_list_of_prompts(client, model, cluster):
    prompts = ["Roses are red,", "The sky is", "1, 2, 3,", "Hello, my name is"]
    out = client.completions.create(model=model, prompt=prompts, max_tokens=5, temperature=0.0, echo=True)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for prompt, choice in zip(prompts, out.choices):
        assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
        alone = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0.0)
        assert choice.text == prompt + alone.choices[0].text
    scored = client.completions.create(model=model, prompt="The cat sat on the", max_tokens=1, temperature=0.0,
                                       echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == scored.choices[0].text
    wait_idle_without_leak(cluster[0])


@pytest.mark.parametrize("kwargs, param", [
    ({"n": 17}, "n"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"),
    ({"logit_bias": {"not-a-token": 5}}, "logit_bias"),
    ({"logit_bias": {"5": -101}}, "logit_bias"),
])
def test_bad_choice_and_bias_requests_are_400_and_leak_nothing(client, model, cluster, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hi", max_tokens=2, **kwargs)
    assert info.value.response.json()["error"]["param"] == param
    wait_idle_without_leak(cluster[0])
