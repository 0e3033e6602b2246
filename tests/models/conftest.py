"""The model tests' paged-KV driver, HF logits oracle and rope settings (the tiny
HF configs and models come from ``tests/factories.py``).

``PagedDriver`` plays the model runner in miniature: it owns a small KV cache
(one tensor per layer, ``attention/base.py`` layout), hands out blocks to
requests in a scrambled order (so block tables are not the identity), builds
``AttentionMetadata`` for a step of several requests (decodes first) and
returns the logits of every new token.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Collection, Optional

import pytest
import torch

from workers.model.attention.base import AttentionMetadata
from workers.model.attention.torch_backend import TorchAttentionBackend
from workers.model.llama import LlamaForCausalLM

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # With theta 1e4 and head_dim 16, all three bands (kept, interpolated, divided) occur.
    "original_max_position_embeddings": 32,
}


def save_hf_model(model, path: Path, max_shard_size: Optional[str] = None) -> Path:
    """``save_pretrained`` as safetensors (sharded when ``max_shard_size`` is given)."""
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


@torch.inference_mode()
def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    """HF float32 logits ``[T, vocab]`` of every position of one sequence."""
    return model(torch.tensor([token_ids])).logits[0].float()


@dataclass
class _Request:
    token_ids: list[int] = field(default_factory=list)  # tokens whose KV is cached
    block_ids: list[int] = field(default_factory=list)


class PagedDriver:
    """Runs our model step by step over a paged KV cache, like the runner does.

    Args:
        model: Our model.
        num_blocks: Blocks in the cache (small, to exercise block tables).
        block_size: Tokens per block.
    """

    def __init__(self, model: LlamaForCausalLM, num_blocks: int = 64, block_size: int = 4, seed: int = 0) -> None:
        arch = model.arch
        self.model = model
        self.block_size = block_size
        dtype = model.model.embed_tokens.weight.dtype
        shape = (2, num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype) for _ in range(arch.num_hidden_layers)]
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.requests: dict[str, _Request] = {}

    def step(self, chunks: dict[str, list[int]], long: Collection[str] = ()) -> dict[str, torch.Tensor]:
        """Computes one step; ``chunks`` maps request id -> its new tokens; the
        requests in ``long`` use a longrope model's long factors.

        Returns:
            Request id -> float32 logits ``[len(new tokens), vocab]``.
        """
        # Decodes first, as the runner orders them (backends may use a fast path).
        order = sorted(chunks, key=lambda rid: len(chunks[rid]) != 1)
        input_ids, positions, slots, starts, seq_lens, tables = [], [], [], [0], [], []
        for rid in order:
            req = self.requests.setdefault(rid, _Request())
            new = chunks[rid]
            first = len(req.token_ids)
            req.token_ids.extend(new)
            while len(req.block_ids) * self.block_size < len(req.token_ids):
                req.block_ids.append(self.free_blocks.pop())
            for pos in range(first, len(req.token_ids)):
                slots.append(req.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size)
            input_ids.extend(new)
            offset = self.model.long_rope_rows if rid in long else 0
            positions.extend(range(first + offset, len(req.token_ids) + offset))
            starts.append(starts[-1] + len(new))
            seq_lens.append(len(req.token_ids))
            tables.append(req.block_ids)
        query_lens = [len(chunks[rid]) for rid in order]
        meta = AttentionMetadata.build(slots, query_lens, seq_lens, tables)
        hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, meta)
        logits = self.model.compute_logits(hidden)
        return {rid: logits[starts[i] : starts[i + 1]] for i, rid in enumerate(order)}


@pytest.fixture
def attn_backend() -> TorchAttentionBackend:
    return TorchAttentionBackend()
