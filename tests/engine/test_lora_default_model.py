"""Multi-LoRA on the default model (SmolLM2-135M, the packaged GGUF read as
float32): three random PEFT adapters of different ranks and targets, mixed
with base requests in one batch and again on prefix hits, give greedy tokens
identical to transformers running PEFT's own unmerged forward in float32 on
the same weights (``test_lora.py`` does the same on random-init Llama, Qwen3
and Gemma 3 models)."""

from __future__ import annotations

import random

import pytest

from tests.engine.test_lora import ADAPTERS, MIXED, greedy, peft_greedy, save_adapter
from cluster.shared.types import LoRARequest
from workers.llm import LLM
from workers.model.loader import resolve_model

PROMPT_LENS = [5, 13, 21, 30, 9, 40]
MAX_TOKENS = [6, 5, 7, 4, 8, 6]


@pytest.fixture(scope="module")
def default_case(tmp_path_factory):
    base = resolve_model(None)  # the converted safetensors folder transformers reads too
    root = tmp_path_factory.mktemp("lora-default")
    adapters = {name: save_adapter(base, root / name, *spec, seed=30 + i) for i, (name, spec) in
                enumerate(ADAPTERS.items())}
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 49152) for _ in range(n)] for n in PROMPT_LENS]
    prompts[-1] = prompts[3][:24] + prompts[-1][24:]  # a shared prefix
    expected = {name: peft_greedy(base, path, prompts, MAX_TOKENS)
                for name, path in [(None, None), *adapters.items()]}
    return adapters, prompts, expected


def test_default_model_adapters_mixed_match_peft(default_case):
    adapters, prompts, expected = default_case
    for name in ADAPTERS:
        assert expected[name] != expected[None], name  # each adapter changes the output
    requests = [None if n is None else LoRARequest(n, 1, str(adapters[n])) for n in MIXED]
    want = [expected[name][i] for i, name in enumerate(MIXED)]
    with LLM(enable_lora=True, max_loras=3, max_lora_rank=16, block_size=4, max_model_len=256, seed=0) as llm:
        for _ in range(2):  # the second round: prefix hits on each adapter's own chain
            outs = llm.generate(prompts, [greedy(n) for n in MAX_TOKENS], lora_request=requests)
            assert [o.token_ids for o in outs] == want
