"""Structured outputs' engine parts without a model: drafts trimmed by the
grammar, draft masks, jump-forward proposals, the native mask kernel and the
request-side contract."""

from __future__ import annotations

import pytest
import torch

from cluster.shared.structured import StructuredOutputsParams
from cluster.shared.types import SamplingParams
from workers.engine.structured import JumpForwardProposer, fill_draft_masks, trim_drafts
from workers.model import cpu_ops
from workers.model.sampler import apply_token_bitmask, unpack_bitmask


class WordState:
    """A grammar over token ids whose only sentence is ``word`` (then EOS 0)."""

    def __init__(self, word: list[int]) -> None:
        self.word = word + [0]
        self.pos = 0
        self.history: list[int] = []

    def accept(self, token_id: int) -> bool:
        if self.pos < len(self.word) and self.word[self.pos] == token_id:
            self.pos += 1
            self.history.append(token_id)
            return True
        return False

    def rollback(self, n: int) -> None:
        self.pos -= n
        del self.history[len(self.history) - n:]

    def fill_mask(self, masks: torch.Tensor, row: int) -> None:
        masks[row] = 0
        if self.pos < len(self.word):
            token = self.word[self.pos]
            masks[row, token // 32] = 1 << (token % 32)

    def is_terminated(self) -> bool:
        return self.pos == len(self.word)

    def jump_forward(self, limit: int) -> list[int]:
        return self.word[self.pos:len(self.word) - 1][:limit]  # EOS is never forced text


class Backend:
    def allocate_masks(self, rows: int) -> torch.Tensor:
        return torch.zeros(rows, 4, dtype=torch.int32)


def test_a_chain_of_drafts_is_cut_at_the_first_token_the_grammar_rejects():
    state = WordState([5, 6, 7, 8])
    assert trim_drafts(state, [5, 6, 9, 8], []) == ([5, 6], [])
    assert state.pos == 0  # left as it was
    assert trim_drafts(state, [4], []) == ([], [])


def test_a_tree_loses_each_rejected_node_with_its_subtree():
    state = WordState([5, 6, 7])
    # fed -> 5 -> 6 -> 7 ; fed -> 9 -> 6 ; 5 -> 8
    drafts, parents = [5, 6, 7, 9, 6, 8], [-1, 0, 1, -1, 3, 0]
    assert trim_drafts(state, drafts, parents) == ([5, 6, 7], [])
    assert trim_drafts(state, [9, 5, 6], [-1, -1, 1]) == ([5, 6], [])
    assert state.pos == 0


def test_draft_masks_follow_each_draft_path():
    state = WordState([5, 40, 70])
    masks = fill_draft_masks(state, Backend(), [5, 40], [])
    allowed = unpack_bitmask(masks, 128)
    assert [row.nonzero().flatten().tolist() for row in allowed] == [[5], [40], [70]]
    assert state.pos == 0


def test_jump_forward_proposes_forced_tokens_before_the_fallback():
    class Fallback:
        def propose(self, request_id, token_ids, k):
            return [99] * k

        def drop(self, request_id):
            pass

    states = {"a": WordState([5, 6, 7])}
    proposer = JumpForwardProposer(states.get, limit=2, fallback=Fallback())
    assert proposer.propose("a", [1], 4) == [5, 6]
    assert proposer.propose("b", [1], 3) == [99, 99, 99]  # unconstrained: the configured proposer
    assert proposer.num_proposed_tokens == 2
    assert JumpForwardProposer(states.get, limit=4).propose("b", [1], 3) == []


@pytest.mark.parametrize("vocab", [64, 1000, 49152])
def test_the_native_mask_matches_torch_on_the_masked_rows_only(vocab):
    lib = cpu_ops.load()
    if not lib:
        pytest.skip("no C compiler")
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    words = (vocab + 31) // 32
    packed = torch.randint(-2**31, 2**31 - 1, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
    packed[1, : words // 2] = -1  # all allowed: skipped words
    packed[2, : words // 2] = 0  # none allowed: filled words
    rows = [0, 2, 4]
    expected = logits.clone()
    apply_token_bitmask(expected, rows, packed)
    got = logits.clone()
    cpu_ops.mask_rows(lib, got, torch.tensor(rows), packed)
    assert torch.equal(got, expected)
    assert torch.equal(got[[1, 3]], logits[[1, 3]])
    allowed = unpack_bitmask(packed, vocab)
    assert torch.equal(torch.isinf(got[rows]), ~allowed)


def test_structured_outputs_params_name_what_to_change():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice must hold"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="unknown structured_outputs key 'jsn'"):
        StructuredOutputsParams.from_mapping({"jsn": {}})
    so = SamplingParams(structured_outputs={"json": {"type": "object", "properties": {"b": {}, "a": {}}}})
    assert so.structured_outputs.json == '{"type":"object","properties":{"b":{},"a":{}}}'  # key order kept
    assert StructuredOutputsParams(choice=["x", "y"]).cache_key == ("choice", '["x", "y"]', None, None)
    assert hash(so) == hash(SamplingParams(structured_outputs=so.structured_outputs))
