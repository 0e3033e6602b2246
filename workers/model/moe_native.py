"""A mixture-of-experts layer's routed experts in one native call
(``csrc/moe_f32.c``): the router's GEMM, softmax and top-k per token, each
chosen expert once over the tokens that chose it (gate/up, SiLU and down on
the same kernels as its :class:`Linear` layers: packed float ``gemm.py`` or
group-quantized ``qgemm.py``), and each token's weighted outputs added in
ascending expert order, then Qwen2-MoE's shared expert times the sigmoid of
its gate (``1 / (1 + expf(-g))``, not torch's sigmoid: the module runs this
call, so both paths agree). ``moe.py`` runs it where every piece is native;
the step driver (``native_decoder.py``) calls the same function through a
pointer, so a decode step of a Mixtral is one C call as a dense model's is.

The same bits as ``SparseMoE``'s torch loop given the same routing
(``route``, which the module also takes from here): the experts' rows are
the same kernel calls, and ``y * w`` is rounded before it is added
(``-ffp-contract=off``), as torch's two ops round it.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional

import torch

from workers.model import cpu_ops, gemm, native, qgemm
from workers.model.native_structs import L, Fns, Lin, P, address, linear_struct, set_qgemm

_SOURCE = native.source("moe_f32.c")
_FLAGS = (*native.FLAGS, "-ffp-contract=off")
_SIGNATURES = {"moe_route_f32": [P, L, L, L, L, P, P], "moe_forward_f32": [P, P, P, L, L, P]}


class MoeStruct(ctypes.Structure):
    """``moe_t`` of ``csrc/decoder_types.h``."""

    _fields_ = [("router", Lin), ("gate_up", P), ("down", P), ("num_experts", L), ("top_k", L), ("norm_topk", L),
                ("inter", L), ("dense", L), ("panel_width", L), ("gemm_panel_width", L),
                ("shared_gate_up", Lin), ("shared_down", Lin), ("shared_gate", Lin), ("shared_inter", L)]


def load() -> Optional[ctypes.CDLL]:
    """The built kernel, or None (no compiler or a failed build)."""
    return native.build("moe_f32", _SOURCE, _FLAGS, _SIGNATURES)


class NativeMoE:
    """One ``SparseMoE`` (its shared expert too) on the
    native kernels. Build it with :meth:`try_build` once the layer's linears
    are finalized; it points into their packed weights, which the layer keeps."""

    def __init__(self, moe: Any, lib: ctypes.CDLL, router: Lin, gate_up: list[Lin], down: list[Lin],
                 fns: Fns, shared: Optional[tuple[Lin, Lin, Lin]] = None) -> None:
        self.lib, self.fns = lib, fns
        self.top_k, self.norm_topk = moe.top_k, bool(moe.norm_topk_prob)
        self.hidden_size = moe.gate.in_features
        self._gate_up = (Lin * len(gate_up))(*gate_up)
        self._down = (Lin * len(down))(*down)
        qlib = qgemm.load() if fns.qgemm_panels else None
        self.struct = MoeStruct(router, ctypes.addressof(self._gate_up), ctypes.addressof(self._down),
                                moe.num_experts, moe.top_k, int(self.norm_topk), down[0].k, 0,
                                qlib.qgemm_panel_width() if qlib is not None else 0, gemm.load().gemm_panel_width())
        if shared is not None:  # Qwen2-MoE's gated shared expert, in the same call
            self.struct.shared_gate_up, self.struct.shared_down, self.struct.shared_gate = shared
            self.struct.shared_inter = shared[1].k
        self.fn = lib.moe_forward_f32

    @classmethod
    def try_build(cls, moe: Any) -> Optional["NativeMoE"]:
        """The native layer, or None where a piece is not native (a linear on
        another backend, LoRA side paths, no compiler)."""
        router = linear_struct(moe.gate)
        mlps = list(moe.experts) + ([moe.shared_expert] if moe.shared_expert is not None else [])
        experts = [(linear_struct(e.gate_up_proj), linear_struct(e.down_proj)) for e in mlps]
        gates = [moe.gate] + ([moe.shared_expert_gate] if moe.shared_expert is not None else [])
        shared_gate = linear_struct(gates[-1]) if moe.shared_expert is not None else None
        lins = [router, *(lin for pair in experts for lin in pair)] + ([shared_gate] if len(gates) > 1 else [])
        if any(lin is None or lin.kind not in (0, 1) for lin in lins):
            return None
        if any(m.lora is not None for e in mlps for m in (e.gate_up_proj, e.down_proj)) or \
                any(g.lora is not None for g in gates) or any(type(e.act_fn).__name__ != "SiluAndMul" for e in mlps):
            return None
        lib, ops, gemm_lib = load(), cpu_ops.load(), gemm.load()
        qlib = qgemm.load() if any(lin.kind == 1 for lin in lins) else None
        if lib is None or ops is None or gemm_lib is None or (qlib is None and any(lin.kind == 1 for lin in lins)):
            return None
        fns = Fns(gemm=address(gemm_lib.gemm_f32), silu=address(ops.silu_and_mul_f32), moe=address(lib.moe_forward_f32),
                  gemm_panels=address(gemm_lib.gemm_panels_f32))
        if qlib is not None:
            set_qgemm(fns, qlib)
        routed = experts[: moe.num_experts]
        shared = (*experts[-1], shared_gate) if moe.shared_expert is not None else None
        return cls(moe, lib, router, [g for g, _ in routed], [d for _, d in routed], fns, shared)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] float32, expert ids [T, k] int64)`` from router logits ``[T, E]`` float32."""
        logits = logits.contiguous()
        tokens = logits.shape[0]
        weights = torch.empty(tokens, self.top_k)
        ids = torch.empty(tokens, self.top_k, dtype=torch.int64)
        self.lib.moe_route_f32(logits.data_ptr(), tokens, logits.shape[1], self.top_k, int(self.norm_topk),
                               weights.data_ptr(), ids.data_ptr())
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output (before TP's sum) for ``x [T, hidden]`` float32 on CPU."""
        x = x.contiguous()
        out = torch.empty_like(x)
        self.fn(ctypes.byref(self.fns), ctypes.byref(self.struct), x.data_ptr(), x.shape[0], x.shape[1],
                out.data_ptr())
        return out
