"""The engine-alone baseline of ``bench serve --engine-baseline``."""

from __future__ import annotations

import math

import pytest

from cluster.bench import engine_baseline
from tests.factories import make_tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("baseline-llama"))


@pytest.mark.parametrize("num_prompts, samples", [(3, 3), (7, engine_baseline.PREFILL_SAMPLES)])
def test_prefill_is_a_median_over_several_prompts_and_every_request_runs(model_dir, num_prompts, samples):
    prompts = [[5 + i, 6, 7, 8, 9 + i] * 4 for i in range(num_prompts)]
    figures = engine_baseline.run({"model": str(model_dir), "block_size": 4, "num_kv_blocks": 128}, prompts,
                                  [6] * num_prompts, max_concurrency=2)
    assert figures["prefill_samples"] == samples
    assert figures["max_num_seqs"] == 2
    assert figures["prompt_tokens"] == 20
    for key in ("step_ms", "prefill_ms", "output_throughput"):
        assert math.isfinite(figures[key]) and figures[key] > 0, key


def test_at_batch_one_every_request_of_the_throughput_run_is_sampled_too(model_dir):
    prompts = [[5 + i, 6, 7, 8, 9 + i] * 4 for i in range(3)]
    figures = engine_baseline.run({"model": str(model_dir), "block_size": 4, "num_kv_blocks": 128}, prompts,
                                  [6] * 3, max_concurrency=1)
    assert figures["max_num_seqs"] == 1
    assert figures["prefill_samples"] == 3 + 3  # the prompts run alone, then the throughput run's
    assert figures["decode_samples"] == 5 + 3 * 5  # the first request alone, then every request's 5 decode steps
