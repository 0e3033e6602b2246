"""``enforce_eager=False``: the decoder stack under ``torch.compile`` gives the
eager engine's tokens, and the number of graphs stays bounded however the
step size varies (the token dimension is dynamic)."""

from __future__ import annotations

import random

import pytest

from cluster.shared.types import SamplingParams
from tests.factories import make_tiny_model_dir
from workers.llm import LLM


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("compiled"))


def test_compiled_matches_eager_with_bounded_compilations(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path))  # a cold inductor cache: compilations counted
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 40))] for _ in range(12)]
    params = [SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.0, ignore_eos=True) for _ in prompts]
    eager = LLM(str(model_dir), block_size=4, max_num_batched_tokens=24, max_num_seqs=6)
    compiled = LLM(str(model_dir), block_size=4, max_num_batched_tokens=24, max_num_seqs=6, enforce_eager=False)
    assert compiled.runner.model.compiled is not None and eager.runner.model.compiled is None
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    assert [o.token_ids for o in compiled.generate(prompts, params)] == expected
    # Steps of 1 to 24 tokens ran: one graph for one token, one for every other size.
    assert 1 <= compiled.runner.num_compilations <= 2
    assert eager.runner.num_compilations == 0
