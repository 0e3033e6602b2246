"""``quantization="gguf-a8"`` on the default model: the GGUF file's Q4_1 / Q8_0
tensors against activations quantized to int8 per 32 inputs (``qdot.py``).

Every linear layer and the LM head run on the integer path; the weights are the
file's, exactly (the tied embedding reads the float run's vectors); greedy
output stays close to the float run; and a request's tokens and logprobs are
bitwise the same alone or batched with others (the integer sums are exact).
"""

from __future__ import annotations

import pytest
import torch

from cluster.shared.types import SamplingParams
from workers.llm import LLM
from workers.model import qdot, qgemm
from workers.model.linear import Linear

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not qdot.available(qgemm.load()),
                                                   reason="no native integer kernel here")]

PROMPTS = ["The capital of France is", "Write a short poem about the sea:", "def fibonacci(n):"]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)


def test_gguf_a8_runs_every_layer_on_int8_activations_close_to_the_float_run_and_batch_invariant():
    base = LLM(max_num_seqs=4)
    refs = base.generate(PROMPTS, GREEDY)
    llm = LLM(max_num_seqs=4, quantization="gguf-a8")
    model = llm.runner.model
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    assert all(isinstance(m.quant, qdot.DotQuantWeight) for m in layers.values())
    assert {m.quant.name for m in layers.values() if m is not model.lm_head} == {"q4_1-a8"}
    assert model.lm_head.quant.name == "q8_0-a8"
    assert llm.runner.quantization == "gguf-a8:q4_1-a8+q8_0-a8"
    ids = torch.tensor([0, 17, 49151])
    assert torch.equal(model.model.embed_tokens(ids), base.runner.model.model.embed_tokens(ids))
    batched = llm.generate(PROMPTS, GREEDY)
    # Lossy by the activations' rounding: the first token agrees and its logprob moves little.
    assert [o.token_ids[0] for o in batched] == [r.token_ids[0] for r in refs]
    drift = [abs(o.logprobs[0].logprob - r.logprobs[0].logprob) for o, r in zip(batched, refs)]
    assert max(drift) < 0.2, drift
    for prompt, out in zip(PROMPTS, batched):  # alone: the same bits as in the batch of three
        alone = llm.generate([prompt], GREEDY)[0]
        assert alone.token_ids == out.token_ids
        assert [a.logprob for a in alone.logprobs] == [b.logprob for b in out.logprobs]
