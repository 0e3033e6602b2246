"""Engine config: vLLM-style flat arguments, unknown keys named."""

from __future__ import annotations

import pytest

from cluster.shared.config import EngineConfig


def test_flat_arguments_land_in_their_sections():
    cfg = EngineConfig.from_kwargs(block_size=8, max_num_seqs=4, swap_space=0.5, tensor_parallel_size=1, seed=3)
    assert cfg.cache.block_size == 8
    assert cfg.scheduler.max_num_seqs == 4
    assert cfg.cache.swap_space == 0.5
    assert cfg.seed == 3
    assert EngineConfig.from_kwargs(**cfg.flat()) == cfg


def test_misspelled_argument_is_named_with_a_suggestion():
    with pytest.raises(ValueError, match="'max_num_seq'.*'max_num_seqs'"):
        EngineConfig.from_kwargs(max_num_seq=4)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"block_size": 12}, "power of two"),
        ({"preemption_mode": "kill"}, "preemption_mode"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"dtype": "int8"}, "dtype"),
    ],
)
def test_bad_values_say_what_to_change(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(**kwargs)
