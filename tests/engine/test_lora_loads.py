"""An adapter's life on a replica beyond its tokens: one that leaves (LRU
eviction, an unload, a read-ahead never installed) leaves no tensor behind;
each load's time is observed and priced in prefill tokens for the routers
(``workers/lora/load_cost.py``)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from cluster.shared.types import LoRARequest, SamplingParams
from tests.engine.test_lora import save_adapter
from tests.factories import make_hf_config, make_hf_model
from workers.llm import LLM

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-memory")
    base = root / "base"
    make_hf_model(make_hf_config("llama"), seed=3).save_pretrained(base)
    adapters = {"all16": save_adapter(base, root / "all16", 16, 16, ALL, False, seed=1),
                "qv4": save_adapter(base, root / "qv4", 4, 8, ["q_proj", "v_proj"], False, seed=2),
                "od8": save_adapter(base, root / "od8", 8, 8, ["o_proj", "down_proj"], False, seed=3)}
    return base, adapters


def tensor_refs(manager, name: str) -> list[weakref.ref]:
    """Weak references to every tensor installed for ``name``'s slot."""
    slot = next(slot for key, (_, slot) in manager._loaded.items() if key[0] == name)
    refs = []
    for layer in manager.slots.layers.values():
        packed = layer.grouped.slots.get(slot, ()) if layer.grouped is not None else ()
        refs += [weakref.ref(t) for t in packed if isinstance(t, torch.Tensor)]
    return refs


def test_evicted_and_unloaded_adapters_free_their_tensors(case):
    base, adapters = case
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=16, block_size=4, seed=0)
    manager = llm.engine.lora
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    def run(name: str) -> None:
        llm.generate([[5, 6, 7, 8, 9]], params, lora_request=LoRARequest(name, 1, str(adapters[name])))

    assert manager.num_bytes() == 0
    run("all16")
    big = manager.num_bytes()
    refs = tensor_refs(manager, "all16")
    # Rank 16 on every linear of the tiny model: at least its A and B in float32.
    hidden = make_hf_config("llama").hidden_size
    assert big >= 16 * hidden * 4 * 2
    run("qv4")  # max_cpu_loras 1: all16 is evicted
    gc.collect()
    assert manager.names() == ["qv4"] and manager.num_evictions == 1
    small = manager.num_bytes()
    assert 0 < small < big / 4
    if refs:  # the grouped native kernel holds them (else the per-adapter GEMMs, counted above)
        assert all(ref() is None for ref in refs), "an evicted adapter's packed weights are still referenced"
    refs = tensor_refs(manager, "qv4")
    assert manager.unload("qv4", in_use=()) is True
    gc.collect()
    assert manager.num_bytes() == 0 and manager.names() == []
    assert all(ref() is None for ref in refs)


def test_an_unload_drops_the_adapters_read_ahead(case):
    base, adapters = case
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=16, block_size=4, seed=0)
    manager = llm.engine.lora
    manager.prefetch(LoRARequest("od8", 1, str(adapters["od8"])))  # read, never installed
    read = next(iter(manager._read_ahead.values()))
    refs = [weakref.ref(t) for packed in read.prepared.values() for t in _tensors(packed)]
    assert refs
    del read
    assert manager.unload("od8", in_use=()) is False  # never loaded, but its read-ahead goes
    gc.collect()
    assert manager._read_ahead == {} and all(ref() is None for ref in refs)


def _tensors(packed):
    kind, value = packed
    if kind == "grouped":
        return [t for t in value[2] if isinstance(t, torch.Tensor)]
    return []


def test_load_cost_is_measured_and_published(case):
    """Each load is observed (the metrics take every load's seconds), and the
    replica's price of a load in prefill tokens appears once it prefilled."""
    from workers.lora.load_cost import MIN_PREFILL_TOKENS

    base, adapters = case
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4, seed=0)
    manager = llm.engine.lora
    assert llm.engine.stats().lora_load_tokens == 0.0  # nothing measured: the routers' default stands
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompt = list(range(3, 3 + MIN_PREFILL_TOKENS + 8))
    llm.generate([prompt, prompt[::-1]], params,
                 lora_request=[LoRARequest(n, 1, str(adapters[n])) for n in ("all16", "qv4")])
    seconds = manager.cost.take_load_seconds()
    assert len(seconds) == 2 and all(s > 0 for s in seconds) and manager.cost.take_load_seconds() == []
    cost = manager.cost
    assert cost.prefill_tokens_per_s > 0 and cost.mean_load_s > 0
    assert llm.engine.stats().lora_load_tokens == pytest.approx(cost.mean_load_s * cost.prefill_tokens_per_s)


def test_load_cost_counts_prefill_steps_only():
    from workers.lora.load_cost import MIN_PREFILL_TOKENS, LoadCost

    cost = LoadCost()
    cost.observe_step(8, 0.01)  # a decode step: no rate from it
    assert cost.prefill_tokens_per_s == 0.0 and cost.load_tokens == 0.0
    cost.observe_step(MIN_PREFILL_TOKENS * 4, 0.5)
    cost.observe_load(0.05)
    assert cost.load_tokens == pytest.approx(0.05 * MIN_PREFILL_TOKENS * 8)
    cost.observe_load(0.15)  # the mean moves towards the newer load
    assert 0.05 < cost.mean_load_s < 0.15


def test_run_time_adapters_the_registry_dropped_are_unloaded(case):
    """``drop_unregistered``: a run-time adapter (id > 0: its registry generation) whose
    name is gone from the routers' registry, or listed at another generation, is dropped
    unless a request uses it or it is younger than the grace; id-0 adapters stay."""
    from workers.lora.registry_sync import registered_generations

    base, adapters = case
    llm = LLM(str(base), enable_lora=True, max_loras=3, max_cpu_loras=4, max_lora_rank=16, block_size=4, seed=0,
              lora_modules=[f"fixed={adapters['qv4']}"])
    manager = llm.engine.lora
    for request in (LoRARequest("kept", 7, str(adapters["od8"])), LoRARequest("gone", 8, str(adapters["all16"])),
                    LoRARequest("old", 9, str(adapters["qv4"]))):
        manager.load(request)
    registered = registered_generations({"kept": '{"path": "x", "generation": 7}', "old": '{"generation": 12}',
                                         "junk": "{not json"})
    assert registered == {"kept": 7, "old": 12}
    assert manager.drop_unregistered(registered, in_use=()) == []  # all younger than the grace
    slot_of = {key[0]: slot for key, (_, slot) in manager._loaded.items()}
    before = manager.num_bytes()
    assert manager.drop_unregistered(registered, in_use={slot_of["old"]}, min_age_s=0) == ["gone"]  # old is busy
    assert manager.num_bytes() < before and manager.has_runtime_adapters()
    assert manager.drop_unregistered(registered, in_use=(), min_age_s=0) == ["old"]
    assert sorted(manager.names()) == ["fixed", "kept"]
    from router.lora_registry import KEY_PREFIX
    from workers.lora.registry_sync import KEY_PREFIX as followed

    assert followed == KEY_PREFIX  # the replicas read the hash the routers write
