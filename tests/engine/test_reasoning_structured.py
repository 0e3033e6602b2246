"""A constraint after a think block on the default model: with
``StructuredOutputsParams.reasoning`` the engine leaves the think block free
(text the constraint forbids may appear there) and holds only what follows
``</think>``; without it the constraint holds from the first token."""

from __future__ import annotations

import re

import pytest

from cluster.shared.structured import StructuredOutputsParams
from cluster.shared.types import SamplingParams
from workers.llm import LLM

CONTENT = "[A-Za-z ]{3,24}"
ANGLE = 46  # ">" in SmolLM2's vocabulary: the constraint never allows it


@pytest.fixture(scope="module")
def smol():
    return LLM(block_size=16, max_model_len=256, max_num_seqs=4)


def _prompt(llm: LLM) -> list[int]:
    return llm.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
                      add_special_tokens=False)


def test_the_think_block_is_free_and_the_content_is_held(smol):
    assert smol.encode(">", add_special_tokens=False) == [ANGLE]
    pushed = {ANGLE: 100}  # the model would write ">" wherever it may
    opened = smol.generate([_prompt(smol)], SamplingParams(
        temperature=0, max_tokens=12, logit_bias=pushed,
        structured_outputs=StructuredOutputsParams(regex=CONTENT, reasoning="open")))[0]
    assert opened.text == ">" * 12  # inside the block nothing is constrained (it never closed)
    plain = smol.generate([_prompt(smol)], SamplingParams(
        temperature=0, max_tokens=12, logit_bias=pushed, structured_outputs=StructuredOutputsParams(regex=CONTENT)))[0]
    assert ">" not in plain.text and re.fullmatch(CONTENT, plain.text)
    # "optional": no block opened, so the constraint holds the whole output, as without reasoning.
    optional = smol.generate([_prompt(smol)], SamplingParams(
        temperature=0, max_tokens=12, logit_bias=pushed,
        structured_outputs=StructuredOutputsParams(regex=CONTENT, reasoning="optional")))[0]
    assert optional.text == plain.text
