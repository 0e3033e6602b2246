"""Phi-3 longrope in the engine: a sequence is computed with the long factors
once it is longer than ``original_max_position_embeddings`` (20 here), whole:
crossing it during decode drops its KV and recomputes it long, as transformers'
``generate`` does. Short and long KV of the same tokens differ, so their blocks
hash on different roots and never serve each other from the prefix cache."""

from __future__ import annotations

import random

import pytest

from cluster.shared.hashing import hash_block_chain, root_hash
from cluster.shared.types import SamplingParams
from tests.factories import hf_greedy, make_tiny_model_dir
from tests.unit.engine_fakes import assert_all_blocks_free_or_cached
from workers.engine.sequence import Sequence
from workers.llm import LLM

ORIGINAL = 20


def test_sequence_turns_long_past_the_original_length() -> None:
    seq = Sequence("a", list(range(3, 3 + ORIGINAL)), block_size=4, model_fingerprint="fp",
                   long_rope_after=ORIGINAL)
    short_chain = hash_block_chain(seq.all_token_ids, 4, root_hash("fp"))
    assert not seq.rope_long and seq.block_hashes == short_chain  # the router's chain while short
    seq.num_computed_tokens = ORIGINAL
    seq.append_token(7)  # 21 tokens: transformers' next forward is long
    assert seq.rope_long and seq.rope_restart
    assert seq.hash_root != root_hash("fp") and not set(seq.block_hashes) & set(short_chain)
    assert len(seq.block_hashes) == 5
    other = Sequence("b", seq.all_token_ids, block_size=4, model_fingerprint="fp", long_rope_after=ORIGINAL)
    assert other.rope_long and other.block_hashes == seq.block_hashes and not other.rope_restart


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir("phi3_longrope", tmp_path_factory.mktemp("phi3_longrope"))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_prefix_cache_keeps_short_and_long_apart(model_dir) -> None:
    rng = random.Random(5)
    short = [rng.randrange(3, 512) for _ in range(16)]  # 16 + 4 tokens: short to the end
    long = short + [rng.randrange(3, 512) for _ in range(14)]  # 30: long from the start
    crossing = long[:13]  # 13 + 10 tokens: recomputed long at its 8th output token
    prompts, lengths = [short, long, crossing], [4, 4, 10]
    expected = dict(zip(("short", "long", "crossing"), hf_greedy(model_dir, prompts, lengths)))
    llm = LLM(str(model_dir), block_size=4)

    def run(name: str, prompt: list[int], n: int, cached: int) -> None:
        out = llm.generate([prompt], [greedy(n)])[0]
        assert out.token_ids == expected[name] and out.num_cached_tokens == cached, (name, out.num_cached_tokens)

    run("short", short, 4, 0)
    run("long", long, 4, 0)  # the short KV of its first 16 tokens is not its own
    run("long", long, 4, 28)
    run("short", short, 4, 12)
    run("crossing", crossing, 10, 12)  # its prompt as computed short by `short`
    run("crossing", crossing, 10, 12)
    assert_all_blocks_free_or_cached(llm.engine.scheduler)
