"""Phi-3 longrope on our model against transformers float32 (random-init, original length 20).

transformers picks the short or long factors per forward from its length
(``max(position_ids) + 1 > original_max_position_embeddings``) and scales
cos / sin by the attention factor. Our rotary table holds both sets; a
request's positions pick the long rows when the runner says so
(``rope_long``), whatever else is in the step.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.factories import make_hf_config, make_hf_model
from tests.models.conftest import PagedDriver, hf_logits, save_hf_model
from workers.model.loader import load_model

ATOL = 1e-4
ORIGINAL = 20  # the factory's original_max_position_embeddings


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from workers.model.attention.torch_backend import TorchAttentionBackend

    hf = make_hf_model(make_hf_config("phi3_longrope"))
    folder = save_hf_model(hf, tmp_path_factory.mktemp("phi3_longrope"))
    ours, _ = load_model(folder, "float32", "cpu", TorchAttentionBackend())
    return hf, ours


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("length", [ORIGINAL, ORIGINAL + 1, 3 * ORIGINAL])
def test_rotary_rows_equal_transformers(models, length: int) -> None:
    """Short rows for a forward of at most the original length, long rows beyond
    (``>``, not ``>=``), both times the attention factor, bit for bit."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    hf, ours = models
    rotary = ours.model.rotary_emb
    assert rotary.long_rows == ours.long_rope_rows == hf.config.max_position_embeddings
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = Phi3RotaryEmbedding(hf.config)(x, torch.arange(length)[None])
    half = rotary.head_dim // 2
    offset = rotary.long_rows if length > ORIGINAL else 0
    table = rotary.cos_sin_cache[offset : offset + length]
    assert torch.equal(table[:, 0], cos[0, :, :half]) and torch.equal(table[:, 1], sin[0, :, :half])
    assert not torch.equal(rotary.cos_sin_cache[length - 1], rotary.cos_sin_cache[rotary.long_rows + length - 1])


def test_short_and_long_requests_in_one_step(models) -> None:
    """A short prompt, a long one and a long one's later chunk share a step:
    each gets the logits of its own full-sequence forward in transformers."""
    hf, ours = models
    rng = random.Random(3)
    short, long, chunked = ([rng.randrange(3, 512) for _ in range(n)] for n in (ORIGINAL, 33, 27))
    driver = PagedDriver(ours, block_size=4)
    first = driver.step({"c": chunked[:9]}, long={"c"})["c"]
    out = driver.step({"s": short, "l": long, "c": chunked[9:]}, long={"l", "c"})
    _close(out["s"], hf_logits(hf, short))
    _close(out["l"], hf_logits(hf, long))
    _close(torch.cat([first, out["c"]]), hf_logits(hf, chunked))
    # A decode of the long one next to a fresh short prefill.
    out = driver.step({"l": [7], "t": short[:11]}, long={"l"})
    _close(out["l"], hf_logits(hf, long + [7])[-1:])
    _close(out["t"], hf_logits(hf, short[:11]))
