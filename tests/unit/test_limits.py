"""Input limits (``router.limits``): the checks themselves, and that both front
ends' parsers (gRPC ``router.convert``, HTTP ``router.openai.protocol``) apply
them with messages naming the field, the limit and the value allowed."""

from __future__ import annotations


import pytest

from router.backend import ModelInfo
from router.convert import request_from_proto
from router.limits import LimitError, Limits
from router.openai.protocol import APIError, parse_request
from router.pb import generation_pb2 as pb
from router.tokenizer import RouterTokenizer
from tests.factories import make_router_tokenizer

MAX_MODEL_LEN = 64
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def router_tok(tmp_path_factory) -> RouterTokenizer:
    return make_router_tokenizer(tmp_path_factory.mktemp("limits-tok"), TEMPLATE)


def test_defaults_follow_vllm_and_openai():
    limits = Limits()
    assert limits.max_logprobs == 20 and limits.max_request_bytes == 4 * 2**20
    assert limits.prompt_limit(2048) == 2047
    assert Limits(max_prompt_tokens=100).prompt_limit(2048) == 100
    assert Limits(max_prompt_tokens=5000).prompt_limit(2048) == 2047


@pytest.mark.parametrize("kwargs, message", [
    ({"max_logprobs": 21}, "max_logprobs must be at most 20"),
    ({"max_stop_strings": 0}, "max_stop_strings must be an integer >= 1"),
    ({"max_stop_strings": 65}, "max_stop_strings must be at most 64"),
    ({"max_request_bytes": 10}, "max_request_bytes must be at least 1024"),
    ({"max_prompt_tokens": 0}, "max_prompt_tokens must be an integer >= 1"),
    ({"max_inflight_requests": True}, "max_inflight_requests must be an integer >= 1"),
])
def test_invalid_limits_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Limits(**kwargs)


def test_from_kwargs_keeps_defaults_for_unset_flags_and_names_unknown_ones():
    assert Limits.from_kwargs(max_logprobs=None, max_messages=3) == Limits(max_messages=3)
    with pytest.raises(ValueError, match="unknown limits \\['max_bogus'\\]"):
        Limits.from_kwargs(max_bogus=1)


def test_resolve_max_tokens():
    limits = Limits(max_output_tokens=10)
    assert limits.resolve_max_tokens(None, 5, 64, "max_tokens", default=16) == 10  # capped default
    assert limits.resolve_max_tokens(None, 60, 64, "max_tokens", default=16) == 4  # what the context leaves
    assert limits.resolve_max_tokens(None, 5, 64, "max_tokens", default=None) == 10
    assert Limits().resolve_max_tokens(None, 5, None, "max_tokens", default=None) is None
    assert limits.resolve_max_tokens(7, 5, 64, "max_tokens", default=16) == 7
    with pytest.raises(LimitError, match="max_tokens = 11 exceeds this server's max_output_tokens of 10: "
                                         "request at most 10") as info:
        limits.resolve_max_tokens(11, 5, 64, "max_tokens", default=16)
    assert info.value.param == "max_tokens"
    with pytest.raises(LimitError, match="the prompt has 60 tokens and max_model_len is 64, so request at most 4"):
        Limits().resolve_max_tokens(5, 60, 64, "max_tokens", default=16)


def ids_request(n: int, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5] * n), sampling=pb.SamplingParams(**sampling))


@pytest.mark.parametrize("msg, limits, message", [
    (ids_request(64), Limits(), "prompt_token_ids.ids: the prompt has 64 tokens but max_model_len is 64: "
                                "shorten it to at most 63 tokens"),
    (ids_request(11), Limits(max_prompt_tokens=10), "the prompt has 11 tokens but this server's "
                                                    "max_prompt_tokens is 10: shorten it to at most 10"),
    (ids_request(4, max_tokens=61), Limits(), r"sampling.max_tokens = 61 is too large: .* request at most 60"),
    (ids_request(4, max_tokens=9), Limits(max_output_tokens=8), "sampling.max_tokens = 9 exceeds this server's "
                                                                "max_output_tokens of 8: request at most 8"),
    (ids_request(4, stop=["a"] * 3), Limits(max_stop_strings=2), "sampling.stop has 3 stop strings: this "
                                                                 "server's max_stop_strings is 2"),
    (ids_request(4, stop=["abcd"]), Limits(max_stop_string_chars=3), r"sampling.stop\[0\] has 4 characters: "
                                                                     "this server's max_stop_string_chars is 3"),
    (ids_request(4, stop_token_ids=[1, 2]), Limits(max_stop_token_ids=1), "sampling.stop_token_ids has 2 token "
                                                                          "ids: this server's max_stop_token_ids is 1"),
    (ids_request(4, logprobs=6), Limits(max_logprobs=5), "sampling.logprobs = 6 exceeds this server's "
                                                         "max_logprobs of 5"),
])
def test_grpc_limits_name_the_field_and_the_value_allowed(router_tok, msg, limits, message):
    with pytest.raises(LimitError, match=message):
        request_from_proto(msg, router_tok, MAX_MODEL_LEN, limits)


def test_grpc_message_count_and_unset_max_tokens(router_tok):
    msg = pb.GenerateRequest()
    for _ in range(3):
        msg.messages.items.add(role="user", content="hi")
    with pytest.raises(LimitError, match="messages.items has 3 messages: this server's max_messages is 2"):
        request_from_proto(msg, router_tok, MAX_MODEL_LEN, Limits(max_messages=2))
    # Unset max_tokens: 16, or what the context leaves, or the cap.
    assert request_from_proto(ids_request(4), router_tok, MAX_MODEL_LEN).sampling_params.max_tokens == 16
    assert request_from_proto(ids_request(60), router_tok, MAX_MODEL_LEN).sampling_params.max_tokens == 4
    capped = request_from_proto(ids_request(4), router_tok, MAX_MODEL_LEN, Limits(max_output_tokens=3))
    assert capped.sampling_params.max_tokens == 3


MODEL = ModelInfo("tiny", MAX_MODEL_LEN)


@pytest.mark.parametrize("body, chat, limits, param, message", [
    ({"prompt": [5] * 64}, False, Limits(), "prompt", "prompt: the prompt has 64 tokens but max_model_len is 64"),
    ({"prompt": [5] * 4, "max_tokens": 9}, False, Limits(max_output_tokens=8), "max_tokens",
     "max_tokens = 9 exceeds this server's max_output_tokens of 8"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9}, True,
     Limits(max_output_tokens=8), "max_completion_tokens", "max_completion_tokens = 9 exceeds"),
    ({"prompt": "x", "stop": ["a", "b", "c"]}, False, Limits(max_stop_strings=2), "stop",
     "stop has 3 stop strings: this server's max_stop_strings is 2"),
    ({"prompt": "x", "stop": "abcd"}, False, Limits(max_stop_string_chars=3), "stop",
     "stop\\[0\\] has 4 characters"),
    ({"prompt": "x", "stop_token_ids": [1, 2]}, False, Limits(max_stop_token_ids=1), "stop_token_ids",
     "max_stop_token_ids is 1"),
    ({"prompt": "x", "logprobs": 6}, False, Limits(max_logprobs=5), "logprobs", "max_logprobs of 5"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, True, Limits(),
     "top_logprobs", "top_logprobs = 21 exceeds this server's max_logprobs of 20"),
    ({"messages": [{"role": "user", "content": "x"}] * 3}, True, Limits(max_messages=2), "messages",
     "messages has 3 messages: this server's max_messages is 2"),
    ({"prompt": "x", "n": 5}, False, Limits(max_n=4), "n", "n = 5 exceeds this server's max_n of 4"),
    ({"prompt": "x", "best_of": 5}, False, Limits(max_n=4), "best_of", "max_n of 4"),
    ({"prompt": ["x"] * 5}, False, Limits(max_n=4), "prompt", "prompt = 5 exceeds this server's max_n"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 9}, True, Limits(max_n=8), "n", "max_n of 8"),
    ({"prompt": "x", "seed": 2**64}, False, Limits(), "seed", "seed must be in"),
    ({"prompt": "x", "priority": 2**40}, False, Limits(), "priority", "priority must be in"),
])
def test_http_limits_are_400_naming_the_param(router_tok, body, chat, limits, param, message):
    with pytest.raises(APIError, match=message) as info:
        parse_request(body, chat, router_tok, MODEL, limits)
    assert info.value.status == 400 and info.value.param == param


def test_http_default_max_tokens_respects_the_cap(router_tok):
    chat = parse_request({"messages": [{"role": "user", "content": "x"}]}, True, router_tok, MODEL,
                         Limits(max_output_tokens=5))
    assert chat.request.sampling_params.max_tokens == 5
    completion = parse_request({"prompt": [5] * 60}, False, router_tok, MODEL)
    assert completion.request.sampling_params.max_tokens == 4
