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
