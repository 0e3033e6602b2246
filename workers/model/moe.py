"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks the
top-k experts of each token; only those experts run, each on the tokens
routed to it.

One layer's forward over a flat token batch ``x [T, hidden]``::

    router logits = gate(x)                     [T, E], float32
    probs = softmax(logits); top-k of probs      (renormalised over the k when
                                                 norm_topk_prob: Mixtral always)
    for each expert e that some token chose, ascending:
        rows = the tokens that chose e            (a gather: one GEMM per expert
        y = down_e(silu(gate_e(x[rows])) * up_e(x[rows]))   over its tokens only)
        out[rows] += weight(row, e) * y
    + sigmoid(shared_gate(x)) * shared_expert(x)  (Qwen2-MoE)

Where every piece is native (CPU, float32, the layer's linears on the packed
or quantized kernels), the layer (its shared expert too) runs as one C call (``moe_native.py``:
the same kernels, the same order, the same bits as this loop given its
routing, which then comes from there too); the model installs it at load
(``install_native``).

That is transformers' own order (softmax in float32, top-k, the experts'
outputs added in ascending expert order), so greedy tokens match it. Each
expert's projections are our ``Linear`` (the native packed GEMM on CPU,
whose rows are computed independently), a token's experts are added in
expert order whatever else is in the batch, and the router runs on the same
kernel: a request's outputs do not depend on its batch-mates. The router stays
in float32 under quantization (its logits decide which experts run); the
experts are quantized like any linear layer. Tensor parallelism splits every
expert's intermediate dimension over the ranks (``tp.py``), as the dense MLP's.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from workers.model.linear import Linear
from workers.model.mlp import GatedMLP
from workers.model.moe_native import NativeMoE
from workers.model.tp import TPContext


class SparseMoE(nn.Module):
    """Top-k routed experts, with Qwen2-MoE's gated shared expert when
    ``shared_intermediate_size`` is set.

    Args:
        intermediate_size / shared_intermediate_size: Local sizes (the rank's
            slice of each expert's intermediate dimension with ``tp``).
        num_experts / top_k: Experts of the layer, and how many each token uses.
        norm_topk_prob: Renormalise the k chosen probabilities to sum to 1.
        tp: With a context, every rank holds a slice of every expert, runs the
            same routing (the router is replicated) and sums its partial output
            with the other ranks' once, at the end of the layer.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool, shared_intermediate_size: Optional[int] = None,
                 tp: Optional[TPContext] = None) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.gate.keep_float = True  # the router decides which experts run: never quantized
        self.experts = nn.ModuleList(GatedMLP(hidden_size, intermediate_size) for _ in range(num_experts))
        self.shared_expert: Optional[GatedMLP] = None
        self.shared_expert_gate: Optional[Linear] = None
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)
            self.shared_expert_gate.keep_float = True
        self.native: Optional[NativeMoE] = None  # the routed experts in one C call (install_native)

    def install_native(self) -> bool:
        """Runs the routed experts natively from now on where every piece allows
        (``moe_native.py``); call once the linears are finalized. Returns whether it does."""
        self.native = NativeMoE.try_build(self)
        return self.native is not None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] in x's dtype, expert ids [T, k])`` of each token."""
        if self.native is not None:
            return self.native.route(self.gate(x).float())
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.dtype == torch.float32 and x.dim() == 2 and x.device.type == "cpu":
            out = self.native.forward(x)  # the shared expert too
        else:
            out = self.routed_loop(x, *self.route(x))
            if self.shared_expert is not None:
                assert self.shared_expert_gate is not None
                out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def routed_loop(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum in torch, given the routing (``route``)."""
        out = torch.zeros_like(x)
        for expert_id in torch.unique(ids).tolist():  # ascending, as transformers adds them
            rows, slot = torch.nonzero(ids == expert_id, as_tuple=True)
            y = self.experts[expert_id](x.index_select(0, rows))
            # A token picks an expert once, so rows are distinct: a gather-add-scatter gives index_add_'s
            # bits (one addition per element) without its cost (0.25 ms a call for one row here, more under load).
            out.index_copy_(0, rows, out.index_select(0, rows) + y * weights[rows, slot, None])
        return out
