"""The gated MLP of every family: a fused gate/up projection, an activation of
the gate times the up half, and the down projection.

    SwiGLU (Llama, Qwen, Mistral, Phi-3, each MoE expert):  silu(gate) * up
    GeGLU (Gemma):                                          gelu_tanh(gate) * up

``intermediate_size`` is the local one; ``down_proj`` is row-parallel with a
``tp`` context (an MoE expert takes none: its layer sums once, ``moe.py``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from workers.model.layers import GeluAndMul, SiluAndMul
from workers.model.linear import Linear
from workers.model.tp import TPContext, row_parallel_linear


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with ``gate_up_proj`` fused; ``act`` is
    ``silu`` or ``gelu_pytorch_tanh``."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 tp: Optional[TPContext] = None, act: str = "silu") -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = row_parallel_linear(intermediate_size, hidden_size, bias, tp)
        self.act_fn: nn.Module = SiluAndMul() if act == "silu" else GeluAndMul()

    def gate_up_shard_rows(self, shard_id: str) -> tuple[int, int]:
        """``(first row, number of rows)`` of the gate or up part of ``gate_up_proj``."""
        return (0 if shard_id == "gate" else self.intermediate_size), self.intermediate_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
