"""Sizing the KV cache on a GPU from a profiling step (gpu_memory_utilization),
checked on CPU with the CUDA memory API faked."""

from __future__ import annotations

import pytest
import torch

from cluster.shared.config import EngineConfig
from cluster.shared.sizes import GiB
from workers.provision import kv_budget_bytes, num_kv_blocks_for, profile_batch, profile_step_bytes


def test_profile_batch_fills_the_token_budget_with_the_longest_chunk_first():
    # The first chunk sits at the end of a max_model_len sequence: query x context is largest there.
    assert profile_batch(2048, 64, 8192) == [(6144, 2048)]
    assert profile_batch(100, 8, 64) == [(0, 64), (0, 36)]
    assert profile_batch(1000, 3, 64) == [(0, 64), (0, 64), (0, 64)]  # max_num_seqs caps it
    assert sum(q for _, q in profile_batch(5000, 64, 1024)) == 5000


def test_budget_takes_utilization_less_what_is_used_and_the_step():
    total = 80 * GiB
    assert kv_budget_bytes(total, in_use=10 * GiB, utilization=0.9, activation_bytes=2 * GiB) == 60 * GiB


def _cuda_config(**kwargs) -> EngineConfig:
    return EngineConfig.from_kwargs(device="cuda", **kwargs)


def test_blocks_from_the_profiled_budget(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * GiB, 80 * GiB))  # 10 GiB in use
    config = _cuda_config(max_num_seqs=1024)
    blocks = num_kv_blocks_for(config, GiB // 100, torch.device("cuda"), 8192, activation_bytes=2 * GiB)
    assert blocks == int((72 * GiB - 10 * GiB - 2 * GiB) // (GiB // 100))


def test_no_room_left_says_what_to_change(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 * GiB, 80 * GiB))  # 75 GiB in use
    with pytest.raises(ValueError, match="raise gpu_memory_utilization.*max_num_batched_tokens"):
        num_kv_blocks_for(_cuda_config(), 1 << 20, torch.device("cuda"), 8192, activation_bytes=GiB)


class FakeMemory:
    """Counts like torch.cuda's allocator: a peak since the last reset."""

    def __init__(self, step_peak: int) -> None:
        self.step_peak = step_peak
        self.calls: list[str] = []

    def synchronize(self, device):
        self.calls.append("synchronize")

    def reset_peak_memory_stats(self, device):
        self.calls.append("reset")

    def memory_allocated(self, device):
        self.calls.append("allocated")
        return 5000

    def max_memory_allocated(self, device):
        self.calls.append("peak")
        return 5000 + self.step_peak

    def empty_cache(self):
        self.calls.append("empty_cache")


def test_profiling_step_runs_the_model_over_the_whole_budget(tmp_path):
    from tests.factories import make_tiny_model_dir
    from workers.llm import LLM

    llm = LLM(str(make_tiny_model_dir("llama", tmp_path / "tiny")), num_kv_blocks=32, max_model_len=64,
              max_num_batched_tokens=100, max_num_seqs=8)
    model, arch = llm.runner.model, llm.runner.model.arch
    seen = []
    hook = model.register_forward_hook(lambda module, args, out: seen.append((args[0].shape[0], out.shape)))
    logits_rows = []
    original = model.compute_logits
    model.compute_logits = lambda hidden: logits_rows.append(hidden.shape[0]) or original(hidden)
    memory = FakeMemory(step_peak=123456)
    try:
        peak = profile_step_bytes(model, llm.config, arch.num_key_value_heads, arch.head_dim, torch.float32,
                                  torch.device("cpu"), 64, memory=memory)
    finally:
        hook.remove()
        model.compute_logits = original
    assert peak == 123456
    assert seen and seen[0][0] == 100, "one forward over the whole token budget"
    assert logits_rows == [2], "every sequence of the profiling batch samples"
    # The peak is read after the forward, measured from a reset taken after the dummy cache was allocated.
    assert memory.calls.index("reset") < memory.calls.index("allocated") < memory.calls.index("peak")
    assert memory.calls[-1] == "empty_cache"
