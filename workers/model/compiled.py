"""``enforce_eager=False``: the decoder stack compiled with ``torch.compile``
(inductor), for the elementwise work between the kernels.

What the graph holds and what stays opaque::

    embedding -> [ RMSNorm(+residual) -> qkv GEMM -> RoPE -> attention -> o GEMM
                   -> RMSNorm(+residual) -> gate/up GEMM -> SiLU*mul -> down GEMM ] x L -> norm

Inductor fuses the norms, residual adds, RoPE and SiLU-and-mul into its own
C++ (CPU) or Triton (GPU) kernels. The GEMMs (``prefixserve::gemm``, the
native packed kernel) and attention (``prefixserve::attention``, the
configured backend) are custom ops the graph calls as they are: attention
needs the step's metadata (Python lists, block tables), which would make
every step a new graph if traced, so it reaches the op through the forward
context (``forward_context``, set by the runner around each forward) and the
op keeps only the layer index.

Shapes: the token dimension is dynamic, so one graph serves every step size
(torch specializes one token apart: a decode at batch 1 gets its own graph);
every compilation is counted (``num_compilations``, exported as
``prefixserve:model_compilations_total``) and logged with its time. Inductor's
caches live in ``$PREFIXSERVE_CACHE_DIR/inductor``, so a restart reuses the
compiled code.

The KV-cache write inside the attention op is a side effect the graph does
not see; nothing else in the graph reads the cache, so it cannot be reordered
against a reader.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch

from cluster.shared.cache import cache_root
from workers.model import gemm

logger = logging.getLogger(__name__)

_context = threading.local()


@contextmanager
def forward_context(meta: Any, layers: Any) -> Iterator[None]:
    """Makes ``meta`` (the step's attention metadata) and ``layers`` (the
    attention modules, by layer index) visible to the attention op."""
    _context.meta, _context.layers = meta, layers
    try:
        yield
    finally:
        _context.meta = _context.layers = None


@torch.library.custom_op("prefixserve::gemm", mutates_args=())
def gemm_op(x: torch.Tensor, panels: torch.Tensor, bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    """``x @ W.T (+ b)`` with ``W`` packed in ``panels`` (``gemm.py``)."""
    lib = gemm.load()
    x = x.contiguous()
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    if x.shape[0]:
        lib.gemm_f32(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), panels.data_ptr(), out_features,
                     bias.data_ptr() if bias is not None else None, y.data_ptr(), out_features)
    return y


@gemm_op.register_fake
def _gemm_fake(x: torch.Tensor, panels: torch.Tensor, bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


@torch.library.custom_op("prefixserve::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 layer: int) -> torch.Tensor:
    """Layer ``layer``'s attention over the paged cache with the step's metadata
    (from the forward context); writes the new K/V into ``kv_cache``."""
    attn = _context.layers[layer]
    return attn.attn_backend.forward(q, k, v, kv_cache, _context.meta, attn.scale, attn.sliding_window,
                                     **attn.backend_kwargs).contiguous()


@attention_op.register_fake
def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    layer: int) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


class CompiledDecoder:
    """The model's decoder stack under ``torch.compile``, with a count of compilations.

    Args:
        model: The ``LlamaForCausalLM`` (finalized: kernels installed).
    """

    def __init__(self, model: Any) -> None:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
        import torch._inductor.config as inductor_config

        inductor_config.fx_graph_cache = True
        self.model = model
        self.num_compilations = 0
        self.compile_seconds = 0.0
        self._compiled = torch.compile(model.model.forward, dynamic=True, backend=self._backend())
        for module in model.modules():  # the graph runs torch's elementwise code, fused by inductor
            if hasattr(module, "native") and not hasattr(module, "attn_backend"):
                module.native = None
            if hasattr(module, "attn_backend"):
                module.native = None
                module.use_attention_op = True
            if isinstance(module, torch.nn.Module) and getattr(module, "packed", None) is not None:
                module.use_gemm_op = True
        self.layers = [layer.self_attn for layer in model.model.layers]

    def _backend(self) -> Any:
        from torch._inductor.compile_fx import compile_fx

        def backend(graph_module: torch.fx.GraphModule, example_inputs: list) -> Any:
            self.num_compilations += 1
            started = time.monotonic()
            compiled = compile_fx(graph_module, example_inputs)
            seconds = time.monotonic() - started
            self.compile_seconds += seconds
            logger.info("compiled the decoder stack (graph %d, %d nodes) in %.1f s", self.num_compilations,
                        len(graph_module.graph.nodes), seconds)
            return compiled

        return backend

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 meta: Any) -> torch.Tensor:
        with forward_context(meta, self.layers), torch.inference_mode():
            return self._compiled(input_ids, positions, kv_caches, meta=None)
