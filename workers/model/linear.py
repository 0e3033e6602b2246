"""Linear layers whose matmul kernel is chosen once, at load, per device.

Every projection of the model (fused q/k/v, o, fused gate/up, down, the LM
head) is a :class:`Linear`: ``nn.Linear``'s parameters, so checkpoints load
by name, plus a kernel that :func:`finalize_linears` installs once the weights
are in. The kernel owns the weights in its own layout; the parameter is
emptied so the model holds one copy (a tied embedding then reads its rows
from the LM head's kernel).

Backends (engine argument ``linear_backend``):

    native   our GEMM (``gemm.py``), weights packed in panels: batch-invariant
             (a row's result never depends on its batch-mates), at the memory
             limit for one row. CPU with AVX2 + FMA and a C compiler.
    onednn   oneDNN's linear with prepacked weights (what inductor's freezing
             uses on CPU). Fast for mid-size batches on some CPUs; its
             reduction order may depend on the number of rows.
    torch    ``F.linear``: MKL on CPU, cuBLAS on GPUs.
    auto     native on CPU when it builds, else torch; torch on GPUs.

``prefixserve bench kernels`` measures every backend on the model's shapes.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from cluster.shared.config import LINEAR_BACKENDS
from workers.model import gemm

logger = logging.getLogger(__name__)



Kernel = Callable[[torch.Tensor], torch.Tensor]


class Linear(nn.Linear):
    """``nn.Linear`` whose forward runs an installed kernel (``F.linear`` until one is).

    ``matmul(x)`` is the product without the bias, for layers that add the
    bias later (the row-parallel all-reduce).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.kernel: Optional[Kernel] = None  # x -> x @ W.T + b
        self.kernel_no_bias: Optional[Kernel] = None  # x -> x @ W.T
        self.backend = "torch"
        self.packed: Optional[gemm.PackedWeight] = None
        self.quant: Any = None  # qgemm.QuantWeight when quantized (workers/model/quant/)
        self.use_gemm_op = False  # under torch.compile: the native GEMM as a custom op (compiled.py)
        self.lora: Any = None  # workers.lora.layers.LoRALayer with LoRA enabled: adapters' side paths

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_gemm_op:
            return torch.ops.prefixserve.gemm(x, self.packed.panels, self.packed.bias, self.out_features)
        out = self.kernel(x) if self.kernel is not None else F.linear(x, self.weight, self.bias)
        return out if self.lora is None else self.lora.add_to(x, out)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` without the bias."""
        out = self.kernel_no_bias(x) if self.kernel_no_bias is not None else F.linear(x, self.weight)
        return out if self.lora is None else self.lora.add_to(x, out)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", backend={self.backend}"


class Embedding(nn.Embedding):
    """``nn.Embedding`` that can read its rows from a tied LM head's packed
    weight (:meth:`read_rows_from`), so the model keeps one copy of them."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.packed: Optional[gemm.PackedWeight] = None

    def read_rows_from(self, packed: Any) -> None:
        """Looks rows up in ``packed`` (anything with ``rows(ids)``: a packed or
        quantized LM head) from now on; the plain weight is freed."""
        assert (packed.out_features, packed.in_features) == (self.num_embeddings, self.embedding_dim)
        self.packed = packed
        self.weight = nn.Parameter(torch.empty(0, self.embedding_dim), requires_grad=False)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` (any shape) as ``[*ids.shape, embedding_dim]``."""
        if self.packed is not None:
            return self.packed.rows(ids.reshape(-1)).view(*ids.shape, self.embedding_dim)
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(ids)


def resolve_linear_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The backend ``name`` means on ``device`` / ``dtype``.

    Raises:
        ValueError: Unknown name, or a backend this device or dtype cannot run.
    """
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {name!r}")
    cpu_f32 = device.type == "cpu" and dtype == torch.float32
    if name == "auto":
        return "native" if cpu_f32 and gemm.load() is not None else "torch"
    if name in ("native", "onednn") and not cpu_f32:
        raise ValueError(f"linear_backend {name!r} runs float32 on CPU; got {dtype} on {device}: use 'torch' or 'auto'")
    if name == "native" and gemm.load() is None:
        raise ValueError("linear_backend 'native' needs a C compiler and a CPU with AVX2 + FMA (see the log); "
                         "use 'onednn', 'torch' or 'auto'")
    if name == "onednn" and not torch.backends.mkldnn.is_available():
        raise ValueError("linear_backend 'onednn' needs torch built with oneDNN; use 'native', 'torch' or 'auto'")
    return name


def finalize_linears(model: nn.Module, backend: str, tied: Optional[tuple[Linear, Embedding]] = None) -> int:
    """Installs ``backend``'s kernel (already resolved) in every :class:`Linear`
    of ``model`` once its weights are loaded, and frees the plain weights the
    kernels copied.

    Args:
        tied: ``(lm_head, embedding)`` when they share one weight: with the
            native backend the embedding then reads its rows from the LM
            head's panels; otherwise the shared weight is kept for it.

    Returns:
        The number of layers that got the kernel.
    """
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    if backend != "torch":
        for layer in layers:
            if layer.quant is None:  # quantized layers have their kernel already
                _install(layer, backend)
    rows_from = None
    if tied is not None:
        head, embedding = tied
        rows_from = head.quant if head.quant is not None else head.packed
        if rows_from is not None:
            embedding.read_rows_from(rows_from)
    shared = tied[0] if tied is not None and rows_from is None else None
    if backend != "torch":
        for layer in layers:
            if layer is not shared:
                layer.weight = nn.Parameter(torch.empty(0, layer.in_features), requires_grad=False)
    return len(layers)


def _install(layer: Linear, backend: str) -> None:
    weight = layer.weight.detach().contiguous()
    bias = layer.bias.detach().contiguous() if layer.bias is not None else None
    if backend == "native":
        lib = gemm.load()
        assert lib is not None
        packed = gemm.PackedWeight(weight, bias, lib)
        layer.packed = packed
        layer.kernel, layer.kernel_no_bias = packed.matmul, packed.matmul_no_bias
    elif backend == "onednn":
        packed_w = torch.ops.mkldnn._reorder_linear_weight(weight)

        def with_bias(x: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x, packed_w, bias, "none", [], "")

        def no_bias(x: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x, packed_w, None, "none", [], "")

        layer.kernel, layer.kernel_no_bias = with_bias, no_bias
    else:
        raise AssertionError(f"unknown linear backend {backend!r}")
    layer.backend = backend


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights hold: parameters and buffers, packed panels and
    quantized weights (a tied embedding reading its head's rows counts once)."""
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    for layer in model.modules():
        if isinstance(layer, Linear):
            if layer.quant is not None:
                total += layer.quant.nbytes
            elif layer.packed is not None:
                tensors = [layer.packed.panels] + ([layer.packed.bias] if layer.packed.bias is not None else [])
                total += sum(t.numel() * t.element_size() for t in tensors)
    return total
