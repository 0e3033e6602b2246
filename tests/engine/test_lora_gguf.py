"""LoRA on a GGUF base (``quantization="gguf"``: the file's own Q8_0 / Q4_K /
Q6_K blocks run natively; the adapter stays float): a request's greedy
tokens in a batch mixed with other adapters and base requests equal its
tokens alone, as on the int4 / int8 / w8a8 bases (``test_lora.py``)."""

from __future__ import annotations

import random

import pytest

from cluster.shared.types import LoRARequest, SamplingParams
from tests.engine.test_lora import save_adapter
from tests.models.gguf_families_factory import write_tiny_gguf
from workers.llm import LLM
from workers.model.loader import convert_gguf_cached

# name -> (rank, alpha, targets, rslora): different ranks, targets and the fused parts of both layer groups.
ADAPTERS = {
    "qv4": (4, 8, ["q_proj", "v_proj"], False),
    "all16": (16, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "mlp8": (8, 8, ["gate_proj", "up_proj", "down_proj"], True),
}
MIXED = ["qv4", None, "all16", "mlp8", "all16", None]
PROMPT_LENS = [5, 13, 21, 30, 9, 17]
MAX_TOKENS = [10, 8, 12, 6, 14, 9]


@pytest.fixture(scope="module")
def gguf_case(tmp_path_factory):
    from workers.model import qgemm

    if qgemm.load() is None:
        pytest.skip("no native quantized kernel here")
    root = tmp_path_factory.mktemp("lora-gguf")
    path = write_tiny_gguf(root / "tiny-qwen2.gguf", "qwen2", seed=2, native_types_only=True)
    folder = convert_gguf_cached(path, root / "cache")  # the adapters are made against its float weights
    adapters = {name: save_adapter(folder, root / name, *spec, seed=20 + i) for i, (name, spec) in
                enumerate(ADAPTERS.items())}
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in PROMPT_LENS]
    return path, adapters, prompts


def test_gguf_base_mixed_equals_each_alone(gguf_case):
    path, adapters, prompts = gguf_case
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]

    def request(name):
        return None if name is None else LoRARequest(name, 1, str(adapters[name]))

    with LLM(str(path), quantization="gguf", enable_lora=True, max_loras=3, max_lora_rank=16, block_size=4,
             seed=0) as llm:
        assert llm.runner.model.quantization.startswith("gguf:"), llm.runner.model.quantization
        mixed = [o.token_ids for o in llm.generate(prompts, params, lora_request=[request(n) for n in MIXED])]
        alone = [llm.generate([p], sp, lora_request=request(name))[0].token_ids
                 for p, sp, name in zip(prompts, params, MIXED)]
        base = [o.token_ids for o in llm.generate(prompts, params)]
    assert mixed == alone
    for i, name in enumerate(MIXED):  # base rows are the base model's; every adapter changes its rows
        assert (mixed[i] == base[i]) == (name is None), (i, name)
