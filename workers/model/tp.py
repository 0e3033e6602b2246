"""Tensor parallelism inside the model: which slice of every weight a rank
holds, and the collectives of the sharded layers.

With ``tensor_parallel_size = N`` every rank runs the whole model on its own
slice of the weights (Megatron-style)::

    embed_tokens   vocab rows [v0, v1)        masked lookup, all-reduce (sum)
    qkv_proj       column-parallel            rows of the rank's q and KV heads
    attention      the rank's heads only      KV cache holds its KV heads only
    o_proj         row-parallel               partial sums, all-reduce, + bias once
    gate_up_proj   column-parallel            intermediate rows [i0, i1)
    down_proj      row-parallel               partial sums, all-reduce, + bias once
    lm_head        vocab rows [v0, v1)        logits slices gathered to rank 0
    norms, rotary  replicated

Attention is split by KV-head group, unevenly when the heads do not divide:
KV heads go to ranks as evenly as possible (the first ranks take the extra
one) and each rank takes the query heads of its KV groups. When there are
fewer KV heads than ranks, each KV head is replicated on the ranks that use
it: ranks are dealt to KV heads as evenly as possible, and a head's query
group is split among its ranks (again first ranks first). Every rank needs
at least one query head, so any ``N <= num_attention_heads`` works::

    SmolLM2-135M, 9 q / 3 KV heads, N = 2:
        rank 0: KV heads [0, 2)  q heads [0, 6)
        rank 1: KV heads [2, 3)  q heads [6, 9)
    6 q / 2 KV heads, N = 3 (KV replicated):
        rank 0: KV head 0  q heads [0, 2)
        rank 1: KV head 0  q heads [2, 3)
        rank 2: KV head 1  q heads [3, 6)

The MLP's intermediate size and the vocabulary are split the same way
(first ranks get the extra row). A rank's query heads are always contiguous,
so its slice of ``o_proj``'s input columns is one range.

With ``N = 1`` the model takes no ``TPContext`` and builds plain ``Linear``
and ``Embedding`` modules: the single-process path has no collective and
no extra branch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from workers.model.linear import Embedding, Linear

Range = tuple[int, int]  # (first, count)


def split_evenly(total: int, parts: int) -> list[Range]:
    """``(first, count)`` of each of ``parts`` contiguous slices of ``range(total)``;
    the first ``total % parts`` slices are one longer."""
    base, extra = divmod(total, parts)
    ranges, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        ranges.append((start, size))
        start += size
    return ranges


@dataclass(frozen=True)
class TPShard:
    """What one rank holds (all ranges are ``(first, count)`` in full-model units).

    Attributes:
        rank / world_size: Position in the tensor-parallel group.
        q_heads: The rank's query heads (contiguous).
        kv_heads: The rank's KV heads (one replicated head when KV heads < ranks).
        intermediate: The rank's rows of the MLP's intermediate dimension.
        vocab: The rank's rows of the embedding and the LM head.
        vocab_sizes: Vocab slice size of every rank (for the logits gather).
        moe_intermediate / shared_intermediate: The rank's rows of each routed
            expert's and of the shared expert's intermediate dimension (MoE).
    """

    rank: int
    world_size: int
    q_heads: Range
    kv_heads: Range
    intermediate: Range
    vocab: Range
    vocab_sizes: tuple[int, ...]
    moe_intermediate: Range = (0, 0)
    shared_intermediate: Range = (0, 0)

    @property
    def num_heads(self) -> int:
        return self.q_heads[1]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1]

    @property
    def vocab_size(self) -> int:
        return self.vocab[1]


def _head_ranges(num_heads: int, num_kv_heads: int, world_size: int) -> list[tuple[Range, Range]]:
    """``(q_heads, kv_heads)`` of every rank (see the module docstring)."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= world_size:
        return [((k0 * group, nk * group), (k0, nk)) for k0, nk in split_evenly(num_kv_heads, world_size)]
    out = []
    for kv_head, (_, num_ranks) in enumerate(split_evenly(world_size, num_kv_heads)):
        for q0, nq in split_evenly(group, num_ranks):
            out.append(((kv_head * group + q0, nq), (kv_head, 1)))
    return out


def plan_shards(
    num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int, world_size: int,
    moe_intermediate_size: int = 0, shared_intermediate_size: int = 0,
) -> list[TPShard]:
    """The shard of every rank of a ``world_size``-way tensor-parallel group.

    Raises:
        ValueError: If ``world_size`` exceeds the query heads (a rank would
            hold no head), saying which sizes work.
    """
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
        )
    if world_size > num_heads:
        raise ValueError(
            f"tensor_parallel_size {world_size} exceeds the model's {num_heads} attention heads: every rank "
            f"needs at least one query head; use tensor_parallel_size <= {num_heads}"
        )
    if world_size > intermediate_size or world_size > vocab_size or 0 < moe_intermediate_size < world_size \
            or 0 < shared_intermediate_size < world_size:
        raise ValueError(
            f"tensor_parallel_size {world_size} exceeds the model's intermediate (or expert) or vocab size; lower it"
        )
    heads = _head_ranges(num_heads, num_kv_heads, world_size)
    inter = split_evenly(intermediate_size, world_size)
    vocab = split_evenly(vocab_size, world_size)
    sizes = tuple(n for _, n in vocab)
    moe = split_evenly(moe_intermediate_size, world_size) if moe_intermediate_size else [(0, 0)] * world_size
    shared = split_evenly(shared_intermediate_size, world_size) if shared_intermediate_size else [(0, 0)] * world_size
    return [
        TPShard(rank, world_size, heads[rank][0], heads[rank][1], inter[rank], vocab[rank], sizes, moe[rank],
                shared[rank])
        for rank in range(world_size)
    ]


def _mlp_rows(shard: TPShard, name: str) -> Range:
    """The rank's intermediate rows of the MLP (or expert) that ``name`` belongs to."""
    if ".shared_expert." in name:
        return shard.shared_intermediate
    if ".experts." in name:
        return shard.moe_intermediate
    return shard.intermediate


def shard_checkpoint_tensor(
    shard: TPShard, head_dim: int, name: str, shard_id: str, tensor: torch.Tensor
) -> torch.Tensor:
    """The rank's slice of a checkpoint tensor (a view; unsliced tensors as they are).

    Args:
        shard: The rank's shard.
        head_dim: Size of one attention head.
        name: Our parameter name (fused: ``...qkv_proj.weight``).
        shard_id: ``q``, ``k``, ``v``, ``gate``, ``up`` for parts of fused
            projections, else ``''``.
        tensor: The full checkpoint tensor.
    """
    dim_range: Optional[tuple[int, int, int]] = None  # (dim, first, count)
    if shard_id == "q":
        dim_range = (0, shard.q_heads[0] * head_dim, shard.num_heads * head_dim)
    elif shard_id in ("k", "v"):
        dim_range = (0, shard.kv_heads[0] * head_dim, shard.num_kv_heads * head_dim)
    elif shard_id in ("gate", "up"):
        dim_range = (0, *_mlp_rows(shard, name))
    elif name.endswith(".o_proj.weight"):
        dim_range = (1, shard.q_heads[0] * head_dim, shard.num_heads * head_dim)
    elif name.endswith(".down_proj.weight"):
        dim_range = (1, *_mlp_rows(shard, name))
    elif name in ("model.embed_tokens.weight", "lm_head.weight"):
        dim_range = (0, *shard.vocab)
    if dim_range is None:
        return tensor
    dim, first, count = dim_range
    if tensor.dim() <= dim or tensor.shape[dim] < first + count:
        return tensor  # wrong shape: the loader's shape check reports it
    return tensor.narrow(dim, first, count)


class TPContext:
    """One rank's shard and the process group its sharded layers reduce over.

    ``comm_seconds`` accumulates the wall time spent in collectives (on CPU,
    where gloo calls are synchronous; it includes waiting for slower ranks).

    Args:
        shard: The rank's shard.
        group: The tensor-parallel process group (None: the default group).
    """

    def __init__(self, shard: TPShard, group: Optional[dist.ProcessGroup] = None) -> None:
        self.shard = shard
        self.group = group
        self.comm_seconds = 0.0
        self.num_collectives = 0

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def world_size(self) -> int:
        return self.shard.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` over the ranks, in place; returns it."""
        start = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self.comm_seconds += time.perf_counter() - start
        self.num_collectives += 1
        return x

    def gather_vocab(self, local: torch.Tensor) -> Optional[torch.Tensor]:
        """Concatenates every rank's ``[N, vocab slice]`` logits on rank 0.

        Returns:
            ``[N, vocab_size]`` on rank 0, None on the other ranks.
        """
        start = time.perf_counter()
        sizes = self.shard.vocab_sizes
        width = max(sizes)
        if local.shape[1] < width:  # uneven slices: gather needs equal shapes
            local = F.pad(local, (0, width - local.shape[1]))
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in sizes] if self.rank == 0 else None
        dist.gather(local, parts, dst=0, group=self.group)
        out = None
        if parts is not None:
            out = torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)
        self.comm_seconds += time.perf_counter() - start
        self.num_collectives += 1
        return out


class RowParallelLinear(Linear):
    """A linear layer whose input features are sharded: the rank's partial
    product, summed over ranks, then the (full, replicated) bias once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(self.matmul(x))
        return out if self.bias is None else out.add_(self.bias)


class VocabParallelEmbedding(Embedding):
    """An embedding holding vocab rows ``[first, first + count)``: ids outside
    the slice look up zeros, and the all-reduce fills in every row."""

    def __init__(self, vocab: Range, embedding_dim: int, tp: TPContext) -> None:
        super().__init__(vocab[1], embedding_dim)
        self.vocab_start = vocab[0]
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = self.lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


def row_parallel_linear(in_features: int, out_features: int, bias: bool, tp: Optional[TPContext]) -> Linear:
    """A ``Linear`` without TP, else a ``RowParallelLinear`` (``in_features`` is local)."""
    if tp is None:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


def vocab_embedding(vocab_size: int, hidden_size: int, tp: Optional[TPContext]) -> Embedding:
    """An ``Embedding`` without TP, else the rank's ``VocabParallelEmbedding``."""
    if tp is None:
        return Embedding(vocab_size, hidden_size)
    return VocabParallelEmbedding(tp.shard.vocab, hidden_size, tp)
