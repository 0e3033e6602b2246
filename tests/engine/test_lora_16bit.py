"""Adapters saved in 16 bits (bfloat16 / float16) stay 16-bit in memory and
are widened to float32 in the kernel: greedy tokens identical to transformers
running PEFT's float32 forward on the same adapter (PEFT upcasts the same
values), mixed with a float32 adapter and base requests in one batch; the
float32 widening of a 16-bit adapter is the same content (shared prefix
blocks, same tokens); and the side paths take half the memory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.shared.types import LoRARequest
from tests.engine.test_lora import MAX_TOKENS, LoRACase, greedy, peft_greedy, save_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WEIGHTS = "adapter_model.safetensors"


def converted(src: Path, out: Path, dtype: torch.dtype) -> Path:
    """``src``'s adapter with every tensor stored as ``dtype`` (what saving a 16-bit fine-tune writes)."""
    out.mkdir()
    (out / "adapter_config.json").write_bytes((src / "adapter_config.json").read_bytes())
    save_file({k: v.to(dtype).contiguous() for k, v in load_file(str(src / WEIGHTS)).items()}, str(out / WEIGHTS))
    return out


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> LoRACase:
    root = tmp_path_factory.mktemp("lora-16bit")
    case = LoRACase(root, "llama")
    # rank 12, alpha 7: a scaling (7/12) that no 16-bit B times it would hold exactly
    f32 = save_adapter(case.base, root / "h12-f32", 12, 7, ALL, False, seed=21)
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        case.adapters[name] = converted(f32, root / name, dtype)
        case.adapters[f"{name}-widened"] = converted(case.adapters[name], root / f"{name}-widened", torch.float32)
        case.expected[name] = peft_greedy(case.base, case.adapters[name], case.prompts, MAX_TOKENS)
    return case


def run(llm, case: LoRACase, names: list) -> list[list[int]]:
    outs = llm.generate(case.prompts, [greedy(n) for n in MAX_TOKENS],
                        lora_request=[None if n is None else LoRARequest(n, 1, str(case.adapters[n])) for n in names])
    return [o.token_ids for o in outs]


def test_16_bit_adapters_mixed_with_float32_and_base_match_peft(case):
    for name in ("bf16", "fp16"):
        assert case.expected[name] != case.expected[None], name  # the test can fail
    names = ["bf16", None, "fp16", "all8", "bf16", "fp16"]
    llm = case.llm(max_loras=3, max_num_batched_tokens=16, max_num_seqs=8)
    expected = [case.expected[n][i] for i, n in enumerate(names)]
    assert run(llm, case, names) == expected
    assert run(llm, case, names) == expected  # prefix hits on each adapter's chain
    # Kept in 16 bits: the weights take half the bytes of the same adapter widened to float32 (the
    # kernel's rank ranges and offsets, alike in both, are the little rest).
    manager = llm.engine.lora
    loaded = manager.num_bytes()
    assert manager.unload("bf16", ())
    unloaded = manager.num_bytes()
    llm.generate([case.prompts[0]], greedy(1), lora_request=LoRARequest("w", 1, str(case.adapters["bf16-widened"])))
    half, widened = loaded - unloaded, manager.num_bytes() - unloaded
    assert 1.9 * half < widened < 2 * half, (half, widened)


def test_widened_copy_is_the_same_content(case):
    llm = case.llm(max_loras=2, max_cpu_loras=4)
    prompt = case.prompts[5]
    first = llm.generate([prompt], greedy(MAX_TOKENS[5]), lora_request=LoRARequest("bf16", 1, str(case.adapters["bf16"])))[0]
    again = llm.generate([prompt], greedy(MAX_TOKENS[5]),
                         lora_request=LoRARequest("wide", 2, str(case.adapters["bf16-widened"])))[0]
    assert first.token_ids == again.token_ids == case.expected["bf16"][5]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 36
