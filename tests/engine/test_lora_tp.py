"""Multi-LoRA with tensor parallelism (2 ranks on a real local Ray, gloo on
CPU): each rank holds its shard of every side path (``workers/lora/side_paths.py``),
and greedy tokens stay identical to transformers running PEFT's unmerged
forward, for three adapters mixed with base requests in one batch, and when
``max_cpu_loras=1`` evicts and reloads them, on uneven shards (3 KV heads
and 129 intermediate rows over 2 ranks, with biases) and on Phi-3's fused
qkv_proj / gate_up_proj targets; the driver's manager decides the slots and
every rank holds the same adapters in them."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import ray
import torch

from cluster.shared.ray_local import init_local_ray
from cluster.shared.types import LoRARequest
from tests.engine.test_lora import (MAX_TOKENS, MIXED, PROMPT_LENS, LoRACase, expected_for, greedy, peft_greedy,
                                    run, save_adapter)
from tests.factories import make_hf_config, make_hf_model


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray on loopback (4 logical CPUs: two fractional ranks fit on 2 cores)."""
    started = not ray.is_initialized()
    init_local_ray(num_cpus=4)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def llama(tmp_path_factory, ray_local) -> LoRACase:
    return LoRACase(tmp_path_factory.mktemp("lora-tp-llama"), "llama")


class ShardCase(LoRACase):
    """A ``LoRACase`` on a model with other sizes and its own adapters (name -> LoRACase.ADAPTERS' spec)."""

    def __init__(self, root: Path, family: str, adapters: dict, **sizes) -> None:
        config = make_hf_config(family, **sizes)
        model = make_hf_model(config, seed=3)
        with torch.no_grad():  # HF starts biases at 0: random ones make a bias added twice (or never) show
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0, 0.2)
        self.base = root / "base"
        model.save_pretrained(self.base)
        rng = random.Random(11)
        self.prompts = [[rng.randrange(3, config.vocab_size) for _ in range(n)] for n in PROMPT_LENS]
        self.adapters = {name: save_adapter(self.base, root / name, *spec, seed=i)
                         for i, (name, spec) in enumerate(adapters.items())}
        self.expected = {name: peft_greedy(self.base, path, self.prompts, MAX_TOKENS)
                         for name, path in [(None, None), *self.adapters.items()]}


def layers_holding(llm, slot: int) -> list[list[str]]:
    """Per rank: the layers with a side path in ``slot``."""

    def holding(worker, slot: int) -> list[str]:
        return sorted(name for name, layer in worker.lora.layers.items()
                      if slot in layer.slots or (layer.grouped is not None and slot in layer.grouped.slots))

    return ray.get([rank.__ray_call__.remote(holding, slot) for rank in llm.runner._ranks])


def test_mixed_adapters_match_peft_with_two_ranks(llama, tmp_path):
    with llama.llm(tensor_parallel_size=2) as llm:
        assert run(llm, llama, MIXED) == expected_for(llama, MIXED)
        # A second round: prefix hits on every request's own adapter chain.
        assert run(llm, llama, MIXED) == expected_for(llama, MIXED)
        manager = llm.engine.lora
        assert sorted(manager.names()) == ["all8", "od16", "qv4"]
        # Both ranks hold all8 (every layer) in the slot the driver's manager gave it; qv4 only qkv_proj.
        all8, qv4 = (manager.load(llama.request(name))[1] for name in ("all8", "qv4"))
        assert layers_holding(llm, all8) == [[f"model.layers.{i}.{m}" for i in range(2) for m in
                                              ("mlp.down_proj", "mlp.gate_up_proj", "self_attn.o_proj",
                                               "self_attn.qkv_proj")]] * 2
        assert layers_holding(llm, qv4) == [[f"model.layers.{i}.self_attn.qkv_proj" for i in range(2)]] * 2
        # An adapter for another model is refused by the ranks, with the reason, and nothing changes.
        other = tmp_path / "other-base"
        make_hf_model(make_hf_config("llama", hidden_size=48), seed=1).save_pretrained(other)
        wrong = save_adapter(other, tmp_path / "wrong", 4, 8, ["q_proj"], False, seed=5)
        with pytest.raises(ValueError, match="do not fit"):
            llm.generate([llama.prompts[0]], greedy(2), lora_request=LoRARequest("wrong", 9, str(wrong)))
        assert sorted(manager.names()) == ["all8", "od16", "qv4"]
        assert run(llm, llama, MIXED) == expected_for(llama, MIXED)


def test_eviction_and_reload_stay_exact_with_two_ranks(llama):
    with llama.llm(tensor_parallel_size=2, max_loras=1, max_cpu_loras=1) as llm:
        names = ["qv4", "all8", "od16", None, "qv4", "all8"]
        assert run(llm, llama, names) == expected_for(llama, names)
        manager = llm.engine.lora
        assert manager.names() == ["all8"] and manager.num_evictions >= 2
        loads = manager.num_loads
        # Adapters evicted on every rank and loaded again (into freed slots): still PEFT's tokens.
        again = ["od16", "qv4", None, "od16", "all8", None]
        assert run(llm, llama, again) == expected_for(llama, again)
        assert manager.num_loads >= loads + 2 and len(manager.names()) == 1



SHARD_CASES = {
    # Uneven shards: 3 KV heads and 129 intermediate rows over 2 ranks (rank 0 takes the extra), with biases.
    "uneven": ("llama", {"every": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"], False),
                         "od16": (16, 8, ["o_proj", "down_proj", "up_proj"], True)},
               dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=96, intermediate_size=129,
                    vocab_size=511, attention_bias=True, mlp_bias=True)),
    # Phi-3's fused checkpoint: the adapter targets qkv_proj and gate_up_proj whole; each rank cuts every part.
    "phi3_fused": ("phi3", {"fused": (8, 16, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], False),
                            "qkv4": (4, 8, ["qkv_proj"], False)}, {}),
}


@pytest.mark.parametrize("which", SHARD_CASES)
def test_uneven_and_fused_shards_match_peft(tmp_path, ray_local, which):
    family, adapters, sizes = SHARD_CASES[which]
    case = ShardCase(tmp_path, family, adapters, **sizes)
    first, second = adapters
    for name in adapters:
        assert case.expected[name] != case.expected[None], name
    names = [first, None, second, first, second, None]
    with case.llm(tensor_parallel_size=2, max_num_batched_tokens=16, max_num_seqs=8) as llm:
        assert run(llm, case, names) == expected_for(case, names)
