"""Medusa heads: the checkpoint layout read and written, proposals computed as
the layout says, shape errors named, and ``train-heads`` on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from workers.model.medusa import WEIGHTS, MedusaHeads


def random_heads(hidden: int, vocab: int, num_heads: int, own: bool, seed: int = 0) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(hidden, vocab, num_heads, num_layers=2, own_lm_head=own)
    for p in heads.parameters():
        p.data.normal_(0, 0.3)
    return heads


@pytest.mark.parametrize("own", [False, True], ids=["shared_lm_head", "own_lm_head"])
def test_layout_round_trip_and_proposals(tmp_path, own):
    heads = random_heads(16, 40, 3, own)
    heads.save(tmp_path / "h", extra_config={"note": "x"})
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    assert config["medusa_num_heads"] == 3 and config["medusa_num_layers"] == 2 and config["note"] == "x"
    loaded = MedusaHeads.load(tmp_path / "h", 16, 40)
    lm = torch.randn(40, 16)
    x = torch.randn(5, 16)
    got = loaded.propose(x, 3, lambda h: F.linear(h, lm))
    for i in range(3):  # by hand, from the layout's names
        from safetensors import safe_open

        with safe_open(str(tmp_path / "h" / WEIGHTS), framework="pt") as f:
            h = x
            for j in range(2):
                h = h + F.silu(F.linear(h, f.get_tensor(f"{i}.{j}.linear.weight"), f.get_tensor(f"{i}.{j}.linear.bias")))
            proj = f.get_tensor(f"{i}.2.weight") if own else lm
        assert torch.equal(got[:, i], F.linear(h, proj).argmax(dim=-1))
    assert loaded.propose(x, 2, lambda h: F.linear(h, lm)).shape == (5, 2)


def test_token_conditioned_heads_read_the_sampled_token(tmp_path):
    # Their first block reads [x; e(t)] (W of [H, 2H]); the flag is saved and
    # read back, a config that disagrees with the weights is refused, and
    # proposing without the sampled tokens says what is missing.
    torch.manual_seed(4)
    heads = MedusaHeads(16, 40, 3, num_layers=2, token_conditioned=True)
    for p in heads.parameters():
        p.data.normal_(0, 0.3)
    heads.save(tmp_path / "h")
    assert json.loads((tmp_path / "h" / "config.json").read_text())["medusa_token_conditioned"] is True
    loaded = MedusaHeads.load(tmp_path / "h", 16, 40)
    assert loaded.token_conditioned and tuple(loaded.weights[0].shape) == (16, 32)
    embedding, lm = torch.randn(40, 16), torch.randn(40, 16)
    x, tokens = torch.randn(5, 16), torch.tensor([1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="bind_embedding"):
        loaded.propose(x, 3, lambda h: F.linear(h, lm), tokens)
    loaded.bind_embedding(lambda ids: embedding[ids])
    with pytest.raises(ValueError, match="sampled tokens"):
        loaded.propose(x, 3, lambda h: F.linear(h, lm))
    got = loaded.propose(x, 3, lambda h: F.linear(h, lm), tokens)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "h" / WEIGHTS), framework="pt") as f:
        for i in range(3):  # by hand, from the layout's names
            w = [(f.get_tensor(f"{i}.{j}.linear.weight"), f.get_tensor(f"{i}.{j}.linear.bias")) for j in range(2)]
            h = x + F.silu(F.linear(torch.cat([x, embedding[tokens]], 1), *w[0]))
            h = h + F.silu(F.linear(h, *w[1]))
            assert torch.equal(got[:, i], F.linear(h, lm).argmax(dim=-1))
    assert not torch.equal(got, loaded.propose(x, 3, lambda h: F.linear(h, lm), tokens.flip(0)))
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    config["medusa_token_conditioned"] = False
    (tmp_path / "h" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="reads 32 inputs, not 16: medusa_token_conditioned"):
        MedusaHeads.load(tmp_path / "h", 16, 40)


@pytest.mark.parametrize("conditioned", [False, True], ids=["plain", "token_conditioned"])
def test_bound_heads_compute_every_block_in_one_gemm_as_transform_does(conditioned):
    # bind_lm_head packs the heads' blocks into one GEMM (CPU, one block per
    # head): the logits are transform()'s through the LM head, to rounding.
    from workers.model import gemm
    from workers.model.linear import Linear

    if gemm.load() is None:
        pytest.skip("the native GEMM does not build here")
    torch.manual_seed(6)
    heads = MedusaHeads(16, 40, 3, num_layers=1, token_conditioned=conditioned)
    for p in heads.parameters():
        p.data.normal_(0, 0.3)
    embedding = torch.randn(40, 16)
    heads.bind_embedding(lambda ids: embedding[ids])
    lm = Linear(16, 40, bias=False)
    lm.weight.data.normal_()
    x, tokens = torch.randn(5, 16), torch.tensor([3, 1, 4, 1, 5])
    before, _ = heads._head_logits(x, 3, lm, tokens)
    heads.bind_lm_head(lm)
    assert heads._blocks is not None
    after, _ = heads._head_logits(x, 3, lm, tokens)
    embeds = embedding[tokens] if conditioned else None
    by_hand = torch.stack([F.linear(heads.transform(x, i, embeds), lm.weight) for i in range(3)], dim=1)
    assert torch.allclose(after, by_hand, atol=1e-4) and torch.allclose(before, by_hand, atol=1e-4)
    assert torch.allclose(heads._head_logits(x, 2, lm, tokens)[0], by_hand[:, :2], atol=1e-4)


def test_heads_for_another_model_are_refused(tmp_path):
    random_heads(16, 40, 2, own=True).save(tmp_path / "h")
    with pytest.raises(ValueError, match="hidden size 16, the model 32"):
        MedusaHeads.load(tmp_path / "h", 32, 40)
    with pytest.raises(ValueError, match="projects to 40 tokens, the model has 50"):
        MedusaHeads.load(tmp_path / "h", 16, 50)
    with pytest.raises(ValueError, match="not a Medusa checkpoint"):
        MedusaHeads.load(tmp_path / "missing", 16, 40)
    (tmp_path / "bad").mkdir()
    save_file({"0.0.linear.weight": torch.zeros(16, 16)}, str(tmp_path / "bad" / WEIGHTS))
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"medusa_num_heads": 1}))
    with pytest.raises(Exception):
        MedusaHeads.load(tmp_path / "bad", 16, 40)  # a bias is missing


@pytest.mark.parametrize("own", [False, True], ids=["shared_lm_head", "own_lm_head"])
def test_tree_candidates_are_the_likeliest_top_k_combinations(own):
    # Brute force over every combination of the heads' top-5 tokens: the m
    # candidates are the m largest sums of the heads' log-probabilities, in
    # order, the first being propose()'s chain.
    import itertools

    heads = random_heads(16, 40, 3, own, seed=3)
    lm = torch.randn(40, 16)
    x = torch.randn(4, 16)
    got = heads.propose_candidates(x, 3, 5, lambda h: F.linear(h, lm))
    top1 = heads.propose(x, 3, lambda h: F.linear(h, lm)).tolist()
    for row in range(4):
        lps = [torch.log_softmax(heads.logits(x[row : row + 1], i, lambda h: F.linear(h, lm))[0], -1)
               for i in range(3)]
        def score(combo):
            return sum(float(lps[i][t]) for i, t in enumerate(combo))

        best = sorted(itertools.product(*[lp.topk(5).indices.tolist() for lp in lps]), key=score, reverse=True)[:5]
        assert len({tuple(c) for c in got[row]}) == 5
        assert [score(c) for c in got[row]] == pytest.approx([score(c) for c in best], abs=1e-5)
        assert got[row][0] == top1[row]
    assert heads.propose_candidates(x, 2, 1, lambda h: F.linear(h, lm)) == [[c[:2]] for c in top1]


def test_shortlist_scores_only_its_tokens_and_round_trips(tmp_path):
    # Heads with a vocab_shortlist score the shared LM head's shortlisted rows
    # only (packed once by bind_lm_head): every guess is the best shortlisted
    # token, for chains and tree candidates; the list is saved and read back,
    # and one naming tokens the model does not have is refused.
    from workers.model.linear import Linear

    heads = random_heads(16, 40, 3, own=False, seed=5)
    heads.shortlist = torch.tensor([2, 5, 7, 11, 13, 17, 23, 31, 37])
    heads.save(tmp_path / "h")
    loaded = MedusaHeads.load(tmp_path / "h", 16, 40)
    assert loaded.shortlist.tolist() == heads.shortlist.tolist()
    lm = Linear(16, 40, bias=False)
    lm.weight.data.normal_()
    x = torch.randn(6, 16)
    full = loaded.propose(x, 3, lm)  # not bound yet: every token
    loaded.bind_lm_head(lm)
    got = loaded.propose(x, 3, lm)
    for i in range(3):
        scores = F.linear(loaded.transform(x, i), lm.weight[heads.shortlist])
        assert got[:, i].tolist() == heads.shortlist[scores.argmax(dim=-1)].tolist()
    assert set(got.flatten().tolist()) <= set(heads.shortlist.tolist())
    assert not torch.equal(got, full)  # the test can fail: unbound heads guess other tokens
    from workers.model import gemm

    packed_lm = Linear(16, 40, bias=False)  # packed for the native GEMM: the rows come from the panels
    packed_lm.packed = gemm.PackedWeight(lm.weight.detach(), None, gemm.load())
    packed_lm.weight.data.zero_()
    again = MedusaHeads.load(tmp_path / "h", 16, 40)
    again.bind_lm_head(packed_lm)
    assert torch.equal(again.propose(x, 3, packed_lm), got)
    trees = loaded.propose_candidates(x, 3, 4, lm)
    assert [t[0] for t in trees] == got.tolist()
    assert all(token in heads.shortlist.tolist() for t in trees for c in t for token in c)
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    config["vocab_shortlist"] = [3, 40]
    (tmp_path / "h" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="vocab_shortlist must list token ids below 40"):
        MedusaHeads.load(tmp_path / "h", 16, 40)
