"""Stream migration (router/migration.py) with scripted attempts: a replica
"dies" (Ray's ActorDiedError) after some chunks; the client's stream must
continue with no token duplicated or lost, and usage as for one request."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError

from cluster.shared.types import FinishReason, GenerationRequest, SamplingParams, StreamChunk
from router.migration import MigrationLimitError, continuation, migrating_stream

TARGET = list(range(50, 58))  # what an undisturbed greedy run generates


def make_request(max_tokens: int = 8) -> GenerationRequest:
    return GenerationRequest("r1", [1, 2, 3, 4], SamplingParams(max_tokens=max_tokens, temperature=0.0))


class Script:
    """Each attempt continues TARGET from where its prompt ends; dies after ``die_after[i]`` chunks."""

    def __init__(self, die_after: list, error: BaseException = ActorDiedError()) -> None:
        self.die_after = list(die_after)
        self.error = error
        self.requests: list[GenerationRequest] = []

    async def __call__(self, request: GenerationRequest):
        self.requests.append(request)
        limit = self.die_after.pop(0) if self.die_after else None
        done = len(request.prompt_token_ids) - 4
        todo = TARGET[done: done + request.sampling_params.max_tokens]
        for i, token in enumerate(todo):
            if limit is not None and i == limit:
                raise self.error
            last = i == len(todo) - 1
            yield StreamChunk(request.request_id, [token], f"<{token}>", FinishReason.LENGTH if last else None,
                              prompt_tokens=len(request.prompt_token_ids), completion_tokens=i + 1,
                              cached_prompt_tokens=4 if done == 0 else 0, replica_id=f"replica-{len(self.requests)}")
        if limit is not None and limit >= len(todo):
            raise self.error


def run(script: Script, request: GenerationRequest, limit: int = 3, tokenizer=None) -> list[StreamChunk]:
    async def main():
        return [c async for c in migrating_stream(script, request, limit, tokenizer)]

    return asyncio.run(main())


def test_a_death_mid_stream_continues_on_another_replica_without_gaps():
    script = Script([3])
    chunks = run(script, make_request())
    assert [t for c in chunks for t in c.token_ids] == TARGET
    assert "".join(c.text for c in chunks) == "".join(f"<{t}>" for t in TARGET)
    assert [c.finish_reason for c in chunks].count(FinishReason.LENGTH) == 1 and chunks[-1].finished
    second = script.requests[1]
    assert second.prompt_token_ids == [1, 2, 3, 4] + TARGET[:3]
    assert second.sampling_params.max_tokens == 5 and second.request_id == "r1-m1"
    last = chunks[-1]
    assert (last.request_id, last.prompt_tokens, last.completion_tokens, last.cached_prompt_tokens) == ("r1", 4, 8, 4)


def test_a_death_before_the_first_token_is_a_plain_retry():
    script = Script([0])
    chunks = run(script, make_request())
    assert [t for c in chunks for t in c.token_ids] == TARGET
    assert script.requests[1].prompt_token_ids == [1, 2, 3, 4]


def test_repeated_deaths_up_to_the_limit_then_unavailable():
    assert [t for c in run(Script([1, 1, 1]), make_request(), limit=3) for t in c.token_ids] == TARGET
    with pytest.raises(MigrationLimitError, match="migration limit"):
        run(Script([1, 1, 1, 1]), make_request(), limit=3)
    with pytest.raises(MigrationLimitError):
        run(Script([2]), make_request(), limit=0)


def test_request_errors_are_not_migrated():
    script = Script([2], error=ValueError("bad"))
    with pytest.raises(ValueError, match="bad"):
        run(script, make_request())
    assert len(script.requests) == 1


def test_death_after_the_last_token_ends_the_stream_without_a_new_attempt():
    script = Script([8])  # all 8 tokens streamed, the final chunk never came
    chunks = run(script, make_request())
    assert [t for c in chunks for t in c.token_ids] == TARGET
    assert chunks[-1].finish_reason == FinishReason.LENGTH and chunks[-1].completion_tokens == 8
    assert len(script.requests) == 1


class AngleTokens:
    """A tokenizer whose token t reads ``<t>``."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{t}>" for t in ids)


def test_text_the_dead_replica_held_back_is_sent_with_the_next_chunk():
    class HoldsBack(Script):
        async def __call__(self, request):
            async for chunk in super().__call__(request):
                # The first replica streams tokens but holds their text back (stop-string window).
                yield chunk if len(self.requests) > 1 else StreamChunk(chunk.request_id, chunk.token_ids, "")

    chunks = run(HoldsBack([3]), make_request(), tokenizer=AngleTokens())
    assert "".join(c.text for c in chunks) == AngleTokens().decode(TARGET)


class ByteTokens:
    """Token t is the byte t: multi-byte characters span tokens, and stray bytes decode to U+FFFD."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


class DetokenizingReplica:
    """Each attempt continues ``target`` after its prompt and detokenizes as a replica does
    (``IncrementalDetokenizer`` over its own prompt); dies after ``die_after[i]`` tokens."""

    def __init__(self, prompt, target, die_after):
        self.prompt, self.target, self.die_after = list(prompt), list(target), list(die_after)
        self.requests = []

    async def __call__(self, request):
        from cluster.shared.detokenizer import IncrementalDetokenizer

        self.requests.append(request)
        limit = self.die_after.pop(0) if self.die_after else None
        detok = IncrementalDetokenizer(ByteTokens(), request.prompt_token_ids, request.sampling_params.stop)
        done = len(request.prompt_token_ids) - len(self.prompt)
        todo = self.target[done: done + request.sampling_params.max_tokens]
        for i, token in enumerate(todo):
            if limit is not None and i == limit:
                raise ActorDiedError()
            text = detok.append([token])
            finish = FinishReason.STOP if detok.stopped else FinishReason.LENGTH if i == len(todo) - 1 else None
            if finish is not None:
                text += detok.flush()
            yield StreamChunk(request.request_id, [token], text, finish, prompt_tokens=len(request.prompt_token_ids),
                              completion_tokens=i + 1)
            if finish is not None:
                return


def byte_request(prompt, max_tokens, stop=()):
    return GenerationRequest("b1", list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop))


@pytest.mark.parametrize("die_after", range(1, 12))
def test_migrated_text_is_what_one_replica_sends_even_inside_a_character(die_after):
    # "é" and "ö" are two bytes each; 0xb6 alone and 0xcd 0xb6 are garbage that
    # decodes differently depending on where a decoding window starts.
    prompt = list(b"say: ")
    target = list("héllo wörld".encode()) + [0xCD, 0xB6, 0xB6, 0x41, 0xE2, 0x82]
    reference = run(DetokenizingReplica(prompt, target, []), byte_request(prompt, len(target)), tokenizer=ByteTokens())
    migrated = run(DetokenizingReplica(prompt, target, [die_after]), byte_request(prompt, len(target)),
                   tokenizer=ByteTokens())
    assert [t for c in migrated for t in c.token_ids] == target
    assert "".join(c.text for c in migrated) == "".join(c.text for c in reference)


def test_a_stop_string_straddling_the_migration_point_ends_the_stream():
    prompt = list(b"say: ")
    target = list(b"hello world and more")
    script = DetokenizingReplica(prompt, target, [4])  # dies after "hell"
    chunks = run(script, byte_request(prompt, len(target), stop=("lo w",)), tokenizer=ByteTokens())
    assert "".join(c.text for c in chunks) == "hel"
    assert chunks[-1].finish_reason == FinishReason.STOP
    assert len([t for c in chunks for t in c.token_ids]) < len(target)


def test_continuation_keeps_everything_but_prompt_budget_and_id():
    request = GenerationRequest("x", [9, 9], SamplingParams(max_tokens=10, temperature=0.0, stop=["."]),
                                priority=3, cache_salt="tenant")
    cont = continuation(request, [5, 6], 2)
    assert cont.prompt_token_ids == [9, 9, 5, 6] and cont.sampling_params.max_tokens == 8
    assert (cont.request_id, cont.priority, cont.cache_salt, cont.sampling_params.stop) == ("x-m2", 3, "tenant", (".",))


class ChoiceScript:
    """A request with n choices: choice c continues ``TARGET + 10 * c`` from where its prompt
    ends (a one-choice continuation says which choice it is by its seed); the first attempt
    dies after ``die_after`` rounds of one chunk per choice."""

    def __init__(self, die_after: int) -> None:
        self.die_after = die_after
        self.requests: list[GenerationRequest] = []

    async def __call__(self, request: GenerationRequest):
        self.requests.append(request)
        params = request.sampling_params
        first_attempt = len(self.requests) == 1
        choices = range(params.num_choices) if params.num_choices > 1 else [params.seed - 100]
        done = len(request.prompt_token_ids) - 4
        for i in range(params.max_tokens):
            if first_attempt and i == self.die_after:
                raise ActorDiedError()
            for c in choices:
                last = i == params.max_tokens - 1
                token = TARGET[done + i] + 10 * c
                yield StreamChunk(request.request_id, [token], f"<{token}>", FinishReason.LENGTH if last else None,
                                  prompt_tokens=len(request.prompt_token_ids), completion_tokens=i + 1,
                                  index=c if params.num_choices > 1 else 0,
                                  more_choices=params.num_choices > 1 and not (last and c == choices[-1]))


def test_choices_of_a_dead_replica_continue_each_as_its_own_request():
    from router.migration import migrating_choices

    request = GenerationRequest("r1", [1, 2, 3, 4], SamplingParams(max_tokens=8, temperature=1.0, seed=100, n=3))
    script = ChoiceScript(die_after=3)

    async def main():
        return [c async for c in migrating_choices(script, request, 3, None)]

    chunks = asyncio.run(main())
    for c in range(3):
        mine = [chunk for chunk in chunks if chunk.index == c]
        assert [t for chunk in mine for t in chunk.token_ids] == [t + 10 * c for t in TARGET]
        assert [chunk.finish_reason for chunk in mine].count(FinishReason.LENGTH) == 1
    assert chunks[-1].finished and not any(chunk.finished for chunk in chunks[:-1])
    continued = script.requests[1:]
    assert sorted(r.sampling_params.seed for r in continued) == [100, 101, 102]  # choice i: seed + i
    assert all(r.sampling_params.n == 1 and r.prompt_token_ids[4:] == [t + 10 * (r.sampling_params.seed - 100)
                                                                        for t in TARGET[:3]] for r in continued)
