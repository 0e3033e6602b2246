"""CUDA-graph decode: buckets, persistent buffers and padding rows, run on CPU
with a fake graph that replays the captured forward eagerly on the same
buffers (what a real graph does, without the GPU)."""

from __future__ import annotations

import pytest
import torch

from cluster.shared.types import SamplingParams
from workers.cuda_graphs import graph_batch_sizes, pick_bucket
from workers.runner import ModelRunner


def test_buckets_follow_vllm_and_cover_max_num_seqs():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(8) == [1, 2, 4, 8]
    assert graph_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(4096)[-1] == 512


def test_pick_bucket_is_the_smallest_that_holds_the_step():
    sizes = graph_batch_sizes(64)
    assert [pick_bucket(n, sizes) for n in (1, 2, 3, 5, 8, 9, 64)] == [1, 2, 4, 8, 8, 16, 64]
    assert pick_bucket(65, sizes) is None


class FakeGraphs:
    """capture: runs the forward once and keeps its output tensor; replay: runs
    the same forward on the same buffers and writes that tensor in place."""

    def __init__(self) -> None:
        self.captured: list[int] = []
        self.replayed: list[int] = []

    def capture(self, fn):
        out = fn().clone()
        self.captured.append(out.shape[0])
        return (fn, out), out

    def replay(self, graph):
        fn, out = graph
        self.replayed.append(out.shape[0])
        out.copy_(fn())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.factories import make_tiny_model_dir

    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("graphs") / "tiny")


def _with_graph_runner(llm, sizes, fake):
    old = llm.runner
    arch = old.model.arch
    runner = ModelRunner(old.model, num_layers=arch.num_hidden_layers, num_kv_heads=arch.num_key_value_heads,
                         head_dim=arch.head_dim, block_size=old.block_size, num_kv_blocks=old.num_kv_blocks,
                         num_cpu_blocks=old.num_cpu_blocks, dtype=torch.float32, device=torch.device("cpu"),
                         cuda_graph_sizes=sizes, max_blocks_per_seq=8, graph_api=fake)
    llm.runner = llm.engine.runner = runner
    return runner


def test_replayed_decodes_give_the_eager_tokens_and_leave_other_kv_alone(tiny):
    from workers.llm import LLM

    prompts = [[3, 7, 11, 13, 17], [2, 4], list(range(20, 41)), [9] * 9, [5, 6, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    eager = LLM(str(tiny), num_kv_blocks=40, max_num_seqs=8, max_model_len=128)
    want = [o.token_ids for o in eager.generate(prompts, params)]

    graphed = LLM(str(tiny), num_kv_blocks=40, max_num_seqs=8, max_model_len=128)
    fake = FakeGraphs()
    runner = _with_graph_runner(graphed, [1, 2, 4, 8], fake)
    assert fake.captured == [8, 4, 2, 1], "largest first"
    pad = runner.kv_caches[0][:, 40]
    assert pad.abs().sum() > 0, "capture wrote its padding rows into the pad block"
    assert all(c[:, :40].abs().sum() == 0 for c in runner.kv_caches), "and nowhere else"
    got = [o.token_ids for o in graphed.generate(prompts, params)]
    assert got == want
    assert runner.graphs.num_replays > 0 and set(fake.replayed) <= {8, 4, 2, 1}
    assert 8 in fake.replayed, "5 decodes replay the bucket of 8, padded"
    graphed.engine.scheduler.check_integrity()


def test_steps_a_graph_cannot_hold_run_eagerly(tiny):
    from workers.llm import LLM

    llm = LLM(str(tiny), num_kv_blocks=40, max_num_seqs=8, max_model_len=128)
    fake = FakeGraphs()
    runner = _with_graph_runner(llm, [1, 2], fake)
    # Three at once: more decodes than the largest bucket; prefills never replay.
    outs = llm.generate([[1, 2, 3], [4, 5], [6, 7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=4))
    assert all(len(o.token_ids) == 4 for o in outs)
    assert fake.replayed == [] and runner.graphs.num_replays == 0


def test_step_inputs_reach_a_gpu_through_pinned_memory_without_blocking(monkeypatch):
    from workers.model.attention.base import host_to_device

    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, device, non_blocking=False: calls.append(
        ("to", str(device), non_blocking)) or self)
    out = host_to_device([3, 4], torch.int32, "cuda")
    assert calls == ["pin", ("to", "cuda", True)] and out.tolist() == [3, 4]
    calls.clear()
    assert host_to_device([5], torch.long, "cpu").tolist() == [5] and calls == []  # CPU: no copy at all
