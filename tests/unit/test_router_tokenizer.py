"""The router tokenizes and hashes exactly like the engine; proto <-> Python conversions.

The engine side is built the way ``prefixserve generate [--chat]`` builds it:
``ChatTemplate.render`` then ``LLM.make_request(..., add_special_tokens=not chat)``
then ``Sequence.from_request`` with the loader's fingerprint. ``LLM.make_request``
and ``LLM.encode`` run unbound on the engine's own tokenizer, so no weights load.
"""

from __future__ import annotations

import re

import functools
import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import cluster.shared.fingerprint
from cluster.shared.chat_template import ChatTemplate
from cluster.shared.types import FinishReason, GenerationRequest, ReplicaStats, SamplingParams, StreamChunk
from router.convert import (
    chunk_to_proto,
    replica_stats_to_proto,
    request_from_proto,
    request_to_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
)
from router.pb import generation_pb2 as pb
from router.tokenizer import RouterTokenizer
from tests.factories import import_blocking
from workers.builder import load_tokenizer
from workers.engine.sequence import Sequence
from workers.llm import LLM
from workers.model import loader

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = "You are the support assistant of a bank. " * 20  # several 32-token blocks
CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "How do I reset my card PIN?"},
    {"role": "assistant", "content": "Open the app, then Cards, then Reset PIN."},
    {"role": "user", "content": "And if I have no app? Über-fast please, 日本語 OK."},
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return loader.resolve_model(None)


@pytest.fixture(scope="module")
def router_tok(model_dir) -> RouterTokenizer:
    return RouterTokenizer.from_model_dir(model_dir)


@pytest.fixture(scope="module")
def offline_llm(model_dir):
    """The parts of ``LLM`` that ``make_request`` uses, without loading weights."""
    llm = SimpleNamespace(tokenizer=load_tokenizer(model_dir), model_dir=model_dir, _ids=itertools.count())
    llm.encode = functools.partial(LLM.encode, llm)
    return llm


def engine_sequence(offline_llm, model_dir, prompt: str, chat: bool, block_size: int, cache_salt: str = ""):
    """Token ids and hash chain as ``prefixserve generate [--chat]`` hands them to the engine."""
    if chat:
        prompt = ChatTemplate.from_model_dir(model_dir).render([{"role": "user", "content": prompt}])
    request = LLM.make_request(offline_llm, prompt, SamplingParams(), add_special_tokens=not chat)
    request.cache_salt = cache_salt
    seq = Sequence.from_request(request, block_size=block_size, model_fingerprint=loader.model_fingerprint(model_dir))
    return seq.prompt_token_ids, seq.block_hashes


def test_fingerprint_is_shared_with_the_engine(router_tok, model_dir, tmp_path):
    assert loader.model_fingerprint is cluster.shared.fingerprint.model_fingerprint
    assert router_tok.model_fingerprint == loader.model_fingerprint(model_dir)
    # A plain safetensors folder takes the hashing path (the converted one stores its digest).
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 8}))
    (tmp_path / "model.safetensors").write_bytes(bytes(range(256)) * 1024)
    assert cluster.shared.fingerprint.model_fingerprint(tmp_path) == loader.model_fingerprint(tmp_path)


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("chat", [False, True])
def test_router_and_engine_compute_the_same_ids_and_hashes(router_tok, offline_llm, model_dir, chat, block_size):
    prompt = SYSTEM + "Where is my nearest branch?"
    engine_ids, engine_hashes = engine_sequence(offline_llm, model_dir, prompt, chat, block_size, "tenant-a")
    if chat:
        router_ids = router_tok.render_chat([{"role": "user", "content": prompt}])
    else:
        router_ids = router_tok.encode(prompt)
    assert router_ids == engine_ids
    router_hashes = router_tok.block_hashes(router_ids, None, "tenant-a", block_size)
    assert len(router_hashes) == len(engine_ids) // block_size >= 4
    assert router_hashes == engine_hashes


def test_chat_request_through_the_proto_matches_the_engine(router_tok, offline_llm, model_dir):
    template = ChatTemplate.from_model_dir(model_dir)
    engine_request = LLM.make_request(offline_llm, template.render(CONVERSATION), SamplingParams(),
                                      add_special_tokens=False)
    msg = pb.GenerateRequest(
        messages=pb.ChatMessages(items=[pb.ChatMessage(**m) for m in CONVERSATION]), cache_salt="t1"
    )
    request = request_from_proto(msg, router_tok)
    assert request.prompt_token_ids == engine_request.prompt_token_ids
    engine_request.cache_salt = "t1"
    seq = Sequence.from_request(engine_request, block_size=16, model_fingerprint=loader.model_fingerprint(model_dir))
    assert router_tok.block_hashes(request.prompt_token_ids, None, request.cache_salt, 16) == seq.block_hashes


def test_cache_salt_separates_tenants(router_tok):
    ids = router_tok.encode(SYSTEM)
    chains = [router_tok.block_hashes(ids, None, salt, 16) for salt in ("", "tenant-a", "tenant-b")]
    assert all(len(c) == len(ids) // 16 > 0 for c in chains)
    for a, b in itertools.combinations(chains, 2):
        assert set(a).isdisjoint(b)
    assert router_tok.block_hashes(ids, None, "tenant-a", 16) == chains[1]  # deterministic
    assert router_tok.block_hashes(ids, "other-model", "tenant-a", 16) != chains[1]


def test_model_without_chat_template_rejects_messages(router_tok):
    bare = RouterTokenizer(router_tok.tokenizer, None, "fp")
    with pytest.raises(ValueError, match="no chat template: send prompt or prompt_token_ids"):
        bare.render_chat([{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------- conversions
def test_unset_optional_fields_take_the_python_defaults():
    assert sampling_params_from_proto(pb.SamplingParams()) == SamplingParams()
    # Zero is a value, not "unset": temperature 0 means greedy.
    assert sampling_params_from_proto(pb.SamplingParams(temperature=0.0, seed=0)).greedy


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(max_tokens=5, temperature=0.0, seed=0, logprobs=0),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=-3, stop=("\n\n", "END"),
                   stop_token_ids=(2, 7), ignore_eos=True, repetition_penalty=1.1,
                   presence_penalty=-0.5, frequency_penalty=0.25, logprobs=5),
    SamplingParams(n=3, logit_bias={5: -100.0, 9: 2.5}, allowed_token_ids=(5, 9, 11), bad_words=("no", "never"),
                   min_tokens=2, prompt_logprobs=1),
])
def test_sampling_params_round_trip(params):
    assert sampling_params_from_proto(sampling_params_to_proto(params)) == params


def test_choice_index_and_logprobs_reach_the_proto():
    from cluster.shared.types import TokenLogprob

    entry = TokenLogprob(5, -0.25, ((5, -0.25), (7, -2.0)))
    msg = chunk_to_proto(StreamChunk("r", [5], "a", FinishReason.LENGTH, logprobs=[entry], completion_tokens=4,
                                     prompt_logprobs=[None, entry], index=2, more_choices=True))
    assert msg.index == 2 and msg.finish_reason == "length" and msg.usage.completion_tokens == 4
    assert [(e.token_id, e.logprob) for e in msg.logprobs] == [(5, -0.25)]
    assert [(t.token_id, t.logprob) for t in msg.logprobs[0].top_logprobs] == [(5, -0.25), (7, -2.0)]
    assert len(msg.prompt_logprobs) == 1


@pytest.mark.parametrize("sampling, message", [
    (pb.SamplingParams(n=17), "sampling.n = 17 exceeds this server's max_n of 16"),
    (pb.SamplingParams(logit_bias={5: 101.0}), "sampling.logit_bias[5] = 101.0 is out of range"),
    (pb.SamplingParams(logit_bias={10**6: 1.0}), "sampling.logit_bias names token 1000000"),
    (pb.SamplingParams(allowed_token_ids=[10**6]), "sampling.allowed_token_ids names token"),
])
def test_bad_choice_and_processor_fields_name_the_field(router_tok, sampling, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        request_from_proto(pb.GenerateRequest(prompt="hi", sampling=sampling), router_tok)


def test_request_round_trip(router_tok):
    request = GenerationRequest("req-1", [1, 2, 3], SamplingParams(max_tokens=3, seed=9), priority=-2, cache_salt="t")
    assert request_from_proto(request_to_proto(request), router_tok) == request


def test_text_prompt_adds_special_tokens_and_request_id_is_filled(router_tok):
    request = request_from_proto(pb.GenerateRequest(prompt="Hello there"), router_tok)
    assert request.prompt_token_ids == router_tok.encode("Hello there", add_special_tokens=True)
    assert len(request.request_id) == 32 and request.sampling_params == SamplingParams()


@pytest.mark.parametrize("msg, message", [
    (pb.GenerateRequest(), "no input: set one of prompt, prompt_token_ids or messages"),
    (pb.GenerateRequest(prompt=""), "prompt is empty"),
    (pb.GenerateRequest(prompt_token_ids=pb.TokenIds()), "prompt_token_ids.ids is empty"),
    (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1, 49152])),
     r"prompt_token_ids.ids\[1\] = 49152 is out of range: token ids must be in \[0, 49152\)"),
    (pb.GenerateRequest(messages=pb.ChatMessages()), "messages is empty"),
    (pb.GenerateRequest(messages=pb.ChatMessages(items=[pb.ChatMessage(role="bot", content="x")])),
     r"messages.items\[0\].role must be one of"),
    (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=0)), "sampling.max_tokens must be"),
    (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(top_p=0.0)), r"sampling.top_p must be in \(0, 1\]"),
    (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(temperature=-1)), "sampling.temperature must be >= 0"),
    (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(temperature=float("inf"))),
     "sampling.temperature must be a finite number"),
    (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(top_k=-2)), "sampling.top_k must be"),
    (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(logprobs=21)),
     "sampling.logprobs = 21 exceeds this server's max_logprobs of 20"),
    (pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(stop=[""])), "sampling.stop strings must be non-empty"),
    (pb.GenerateRequest(prompt="x", request_id="r" * 300), "request_id has 300 characters: use at most 256"),
    (pb.GenerateRequest(prompt="x", cache_salt="s" * 300), "cache_salt has 300 characters: use at most 256"),
])
def test_invalid_requests_name_the_field(router_tok, msg, message):
    with pytest.raises(ValueError, match=message):
        request_from_proto(msg, router_tok)


def test_prompt_longer_than_the_model_is_rejected(router_tok):
    msg = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1] * 8))
    with pytest.raises(ValueError, match="prompt has 8 tokens but max_model_len is 8: shorten it to at most 7"):
        request_from_proto(msg, router_tok, max_model_len=8)
    assert len(request_from_proto(msg, router_tok, max_model_len=9).prompt_token_ids) == 8


def test_stream_chunks_and_replica_stats_to_proto():
    mid = chunk_to_proto(StreamChunk("r", [5, 6], "ab", replica_id="rep-0"))
    assert (mid.text, list(mid.token_ids), mid.finish_reason, mid.replica_id) == ("ab", [5, 6], "", "rep-0")
    assert not mid.HasField("usage")
    last = chunk_to_proto(StreamChunk("r", [2], "", FinishReason.STOP, prompt_tokens=9, completion_tokens=3,
                                      cached_prompt_tokens=8, replica_id="rep-0"))
    assert last.finish_reason == "stop"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.cached_prompt_tokens) == (9, 3, 8)
    info = replica_stats_to_proto(ReplicaStats("rep-1", 2, 3, 0, 0.5, 17))
    assert (info.replica_id, info.num_running, info.num_waiting, info.kv_cache_usage, info.num_cached_blocks) == (
        "rep-1", 2, 3, 0.5, 17)


def test_router_modules_load_without_torch_or_workers():
    proc = import_blocking(["router.tokenizer", "router.convert", "router.pb.generation_pb2_grpc"],
                           blocked=["torch", "workers"], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
