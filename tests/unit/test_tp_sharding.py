"""Tensor-parallel sharding arithmetic (``workers/model/tp.py``, no Ray, no
process group): head ranges by KV group (uneven and replicated), MLP and vocab
slices, checkpoint slicing, and rank placement in a placement group."""

from __future__ import annotations

import pytest
import torch

from workers.model.tp import plan_shards, shard_checkpoint_tensor, split_evenly
from workers.placement import RankPlacement, rank_placements, threads_per_rank


def heads(shards):
    return [(s.q_heads, s.kv_heads) for s in shards]


def test_split_evenly_gives_the_extra_rows_to_the_first_slices():
    assert split_evenly(10, 3) == [(0, 4), (4, 3), (7, 3)]
    assert split_evenly(6, 2) == [(0, 3), (3, 3)]
    assert split_evenly(1, 1) == [(0, 1)]
    assert split_evenly(2, 4) == [(0, 1), (1, 1), (2, 0), (2, 0)]


def test_default_model_splits_three_kv_groups_as_two_plus_one():
    # SmolLM2-135M: 9 q heads, 3 KV heads, intermediate 1536, vocab 49152.
    shards = plan_shards(9, 3, 1536, 49152, 2)
    assert heads(shards) == [((0, 6), (0, 2)), ((6, 3), (2, 1))]
    assert [s.intermediate for s in shards] == [(0, 768), (768, 768)]
    assert [s.vocab for s in shards] == [(0, 24576), (24576, 24576)]
    assert [(s.rank, s.world_size) for s in shards] == [(0, 2), (1, 2)]


def test_even_gqa_split():
    assert heads(plan_shards(32, 8, 14336, 128256, 4)) == [
        ((0, 8), (0, 2)), ((8, 8), (2, 2)), ((16, 8), (4, 2)), ((24, 8), (6, 2))
    ]


def test_one_rank_holds_everything():
    (shard,) = plan_shards(9, 3, 1536, 49152, 1)
    assert (shard.q_heads, shard.kv_heads, shard.intermediate, shard.vocab) == ((0, 9), (0, 3), (0, 1536), (0, 49152))


def test_fewer_kv_heads_than_ranks_replicates_each_kv_head_on_the_ranks_using_it():
    # 2 KV heads, 3 q heads each, 3 ranks: KV head 0 on ranks 0 and 1 (q split 2 + 1), head 1 on rank 2.
    assert heads(plan_shards(6, 2, 64, 100, 3)) == [((0, 2), (0, 1)), ((2, 1), (0, 1)), ((3, 3), (1, 1))]
    # MQA: one KV head on every rank, query heads split evenly.
    assert heads(plan_shards(8, 1, 64, 100, 4)) == [((0, 2), (0, 1)), ((2, 2), (0, 1)), ((4, 2), (0, 1)),
                                                    ((6, 2), (0, 1))]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (6, 3), (4, 2), (6, 2), (8, 1), (12, 4), (5, 5)])
def test_every_query_head_has_exactly_one_rank_which_holds_its_kv_head(num_heads, num_kv_heads):
    group = num_heads // num_kv_heads
    for world_size in range(1, num_heads + 1):
        shards = plan_shards(num_heads, num_kv_heads, 97, 101, world_size)
        owner = {}
        for s in shards:
            assert s.num_heads >= 1 and s.num_kv_heads >= 1
            for q in range(s.q_heads[0], s.q_heads[0] + s.num_heads):
                assert q not in owner
                owner[q] = s.rank
                assert s.kv_heads[0] <= q // group < s.kv_heads[0] + s.num_kv_heads
            # The local GQA group is whole: local q heads = local KV heads x a whole group, or a
            # part of one replicated KV head's group.
            assert s.num_heads % s.num_kv_heads == 0
        assert sorted(owner) == list(range(num_heads))
        assert sum(s.intermediate_size for s in shards) == 97
        assert sum(s.vocab_size for s in shards) == 101 and sum(s.vocab_sizes) == 101


def test_more_ranks_than_query_heads_is_refused_with_the_limit():
    with pytest.raises(ValueError, match=r"tensor_parallel_size <= 9"):
        plan_shards(9, 3, 1536, 49152, 10)
    with pytest.raises(ValueError, match=r">= 1"):
        plan_shards(9, 3, 1536, 49152, 0)


def test_uneven_vocab_and_intermediate_slices():
    shards = plan_shards(6, 3, 129, 511, 2)
    assert [s.vocab for s in shards] == [(0, 256), (256, 255)]
    assert shards[0].vocab_sizes == (256, 255)
    assert [s.intermediate for s in shards] == [(0, 65), (65, 64)]


def test_checkpoint_slices_follow_the_shard():
    head_dim = 2
    shard = plan_shards(6, 3, 5, 7, 2)[1]  # q heads [4, 6), KV head [2, 3), intermediate [3, 5), vocab [4, 7)
    rows = torch.arange(12).unsqueeze(1).expand(12, 3)  # a q_proj-like [6 heads * 2, hidden]
    assert shard_checkpoint_tensor(shard, head_dim, "l.qkv_proj.weight", "q", rows)[:, 0].tolist() == [8, 9, 10, 11]
    kv = torch.arange(6).unsqueeze(1)
    assert shard_checkpoint_tensor(shard, head_dim, "l.qkv_proj.weight", "k", kv)[:, 0].tolist() == [4, 5]
    assert shard_checkpoint_tensor(shard, head_dim, "l.qkv_proj.bias", "v", torch.arange(6)).tolist() == [4, 5]
    assert shard_checkpoint_tensor(shard, head_dim, "l.gate_up_proj.weight", "up", torch.arange(5)).tolist() == [3, 4]
    o_proj = torch.arange(12).unsqueeze(0).expand(3, 12)  # [hidden, 6 heads * 2]: input columns
    assert shard_checkpoint_tensor(shard, head_dim, "model.layers.0.self_attn.o_proj.weight", "", o_proj)[0].tolist() \
        == [8, 9, 10, 11]
    down = torch.arange(5).unsqueeze(0)
    assert shard_checkpoint_tensor(shard, head_dim, "model.layers.0.mlp.down_proj.weight", "", down)[0].tolist() \
        == [3, 4]
    embed = torch.arange(7).unsqueeze(1)
    assert shard_checkpoint_tensor(shard, head_dim, "model.embed_tokens.weight", "", embed)[:, 0].tolist() == [4, 5, 6]
    assert shard_checkpoint_tensor(shard, head_dim, "lm_head.weight", "", embed)[:, 0].tolist() == [4, 5, 6]
    # Replicated tensors (norms, row-parallel biases) are taken whole.
    bias = torch.arange(3)
    assert shard_checkpoint_tensor(shard, head_dim, "model.layers.0.self_attn.o_proj.bias", "", bias) is bias
    assert shard_checkpoint_tensor(shard, head_dim, "model.norm.weight", "", bias) is bias


class FakePlacementGroup:
    def __init__(self, bundles):
        self.bundle_specs = bundles


def test_ranks_take_the_last_bundles_of_the_placement_group():
    pg = FakePlacementGroup([{"CPU": 0.5}, {"CPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}])
    assert rank_placements(2, 0.5, 0.0, pg) == [RankPlacement(1.0, 0.0, 1), RankPlacement(1.0, 1.0, 2)]
    assert rank_placements(2, 0.25, 0.0, None) == [RankPlacement(0.25, 0.0), RankPlacement(0.25, 0.0)]
    with pytest.raises(ValueError, match="needs 3: bundle 0 for the replica"):
        rank_placements(2, 0.5, 0.0, FakePlacementGroup([{"CPU": 1.0}, {"CPU": 1.0}]))


def test_threads_per_rank():
    assert threads_per_rank(2.0, 2) == 2
    assert threads_per_rank(0.5, 64) == 1
