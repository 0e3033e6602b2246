"""The decoder stack on native kernels with as little Python as a step allows.

With every kernel native (CPU, float32, ``linear_backend`` native, the fused
ops of ``cpu_ops.py`` and the decode-attention kernel built; no tensor
parallelism, no ``torch.compile``), a layer is nine C calls: norm, q/k/v
GEMM, rotary, attention, o GEMM, norm, gate/up GEMM, SiLU, down GEMM. The
module path spends as long again around them in module calls, views and
argument checks (about 3 µs each, ~25 per layer at one token), which at
batch 1 is a tenth of a step. This path makes the same calls with pointers
and sizes worked out once at load (weights) and once per step (metadata):
the same kernels on the same data, so the same bits as the module path
(``tests/models/test_native_decoder.py``).

Decode-only steps go further: one C call (``decoder_decode`` in ``csrc/decoder_step.c``) runs
every layer, calling the same kernels through function pointers on one
scratch buffer, so a step costs no Python per layer at all (about 2 ms of a
30 ms batch-1 step otherwise). ``bench latency --profile`` keeps the
per-kernel Python loop, whose timers it needs.

Mixture-of-experts layers (Mixtral, Qwen2-MoE's with its shared expert) run
in one more C call (``moe_forward_f32``, ``moe_native.py``), which the module
runs too and the one-call step reaches through a pointer; a layer with
experts off the native kernels keeps its module, in the per-layer loop.

Qwen3 and Gemma 3 run here too: the per-head q/k norms in place in the q/k/v
rows before the rotation (``head_rms_norm_f32``), and for Gemma the embedding
scale, four norms per layer (the attention's and the MLP's outputs normed
before they join the stream), GeGLU (``gelu_tanh_and_mul_f32``, which the
module path calls too) and the sliding-window layers' own RoPE table. Gemma 2
too: the decode kernel caps its attention scores (``softcap`` of
``paged_decode.c``, which the torch backend's capped decodes call as well, so
both paths keep the same bits); its prefill chunks take the module path's
attention (``attention/softcap.py``), as below.

Steps with prefill chunks take the module path's attention for those layers'
attention (views of the q/k/v rows into the backend); everything else stays
here.

LoRA (``workers/lora/``): a layer's side paths are added where
``Linear.forward`` adds them, right after its GEMM: in the per-layer loop by
the layer's ``add_to``, in the one-call step by the same grouped kernel
(``lora_add_f32``) through a function pointer; a step with no adapter rows
skips them.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any, Callable, Optional

import torch

from workers.model import lora_kernels
from workers.model import cpu_ops, gemm, i8gemm, native, qgemm
from workers.model.attention import cpu_decode
from workers.model.layers import GeluAndMul
from workers.model.moe import SparseMoE
from workers.model.moe_native import load as load_moe
from workers.model.native_structs import F, L, Fns, Lin, P, address, lin_struct, set_qgemm, weight_of


class _Layer:
    """One decoder layer's pointers and sizes."""

    __slots__ = ("norm1", "norm2", "norm3", "norm4", "eps", "qkv", "o", "gate_up", "down", "num_heads",
                 "num_kv_heads", "head_dim", "scale", "window", "attn", "linears", "moe", "q_norm", "k_norm",
                 "qk_eps", "gelu", "local", "cap")

    def __init__(self, layer: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        sandwich = hasattr(layer, "pre_feedforward_layernorm")  # Gemma's layout (gemma.py)
        if sandwich:
            norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
        self.norm1, self.norm2, self.norm3, self.norm4 = [n.weight.data_ptr() for n in norms] + [0] * (4 - len(norms))
        self.eps = float(layer.input_layernorm.eps)
        assert all(n.eps == layer.input_layernorm.eps for n in norms)
        self.q_norm = attn.q_norm.weight.data_ptr() if attn.q_norm is not None else 0
        self.k_norm = attn.k_norm.weight.data_ptr() if attn.k_norm is not None else 0
        self.qk_eps = float(attn.q_norm.eps) if attn.q_norm is not None else 0.0
        self.gelu = isinstance(getattr(mlp, "act_fn", None), GeluAndMul)
        self.local = bool(getattr(layer, "local", False))  # Gemma 3's second RoPE table
        self.qkv, self.o = weight_of(attn.qkv_proj), weight_of(attn.o_proj)
        self.moe = mlp if isinstance(mlp, SparseMoE) else None  # its module runs it (one C call where native)
        dense = (mlp.gate_up_proj, mlp.down_proj) if self.moe is None else (None, None)
        self.gate_up, self.down = (weight_of(m) if m is not None else None for m in dense)
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale, self.window = float(attn.scale), int(attn.sliding_window or 0)
        self.cap = float(attn.softcap or 0.0)  # Gemma 2's score cap (0: none)
        self.attn = attn
        self.linears = (attn.qkv_proj, attn.o_proj, *dense)  # their .lora: side paths


_DRIVER_SOURCE = native.source("decoder_step.c")

_P, _L, _F = P, L, F


class _LayerC(ctypes.Structure):
    _fields_ = [("norm1", _P), ("norm2", _P), ("qkv", Lin), ("o", Lin), ("gate_up", Lin), ("down", Lin),
                ("k_cache", _P), ("v_cache", _P), ("window", _L), ("eps", _F), ("scale", _F), ("moe", _P),
                ("q_norm", _P), ("k_norm", _P), ("norm3", _P), ("norm4", _P), ("gelu", _L), ("local", _L),
                ("qk_eps", _F), ("cap", _F)]


_DRIVER_SIGNATURES = {"decoder_decode": [_P, _P, _L, _L, _L, _L, _L, _L, _P, _P, _P, _F, _P, _P, _P, _P, _P, _P, _L,
                                         _P, _L, _L, _P, _P, _P, _L, _P, _L, _P]}


class NativeDecoder:
    """Runs ``model.model`` (embedding, layers, final norm) on the native kernels.

    Build it with :meth:`try_build`, which returns None where a kernel or a
    condition is missing.
    """

    def __init__(self, model: Any, ops: ctypes.CDLL, gemm_lib: ctypes.CDLL, attn_lib: ctypes.CDLL) -> None:
        self.model = model
        self.ops, self.attn_lib = ops, attn_lib
        self._gemm, self._gemm_lib = gemm_lib.gemm_f32, gemm_lib
        qlib = qgemm.load()
        self._qgemm = qlib.qgemm_f32 if qlib is not None else None
        self._norm = ops.add_rms_norm_f32
        self._rotary = ops.rotary_f32
        self._silu = ops.silu_and_mul_f32
        self._gelu = ops.gelu_tanh_and_mul_f32
        self._head_norm = ops.head_rms_norm_f32
        self._decode = attn_lib.paged_decode_f32
        self._decode_int8: Any = None  # built on the first step over an int8 cache
        self.layers = [_Layer(layer) for layer in model.model.layers]
        self.final_norm = model.model.norm.weight.data_ptr()
        self.final_eps = float(model.model.norm.eps)
        self.embed_scale = getattr(model.model, "embed_scale", None)  # Gemma: sqrt(hidden)
        self.hidden_size = model.arch.hidden_size
        self._backend = model.model.layers[0].self_attn.attn_backend
        self.timers: Optional[dict[str, float]] = None  # set by bench latency --profile
        # EAGLE-3 (spec_eagle3.py): per step, None or the capture that keeps the stream entering its
        # ``layer_ids``: ``native_layer(i, stream)`` in the per-layer loop, ``native_step(features)`` after
        # the one-call step, which copies them into ``features`` [len(layer_ids), T, hidden] itself.
        self.aux_capture: Optional[Callable[[], Any]] = None
        # The tensors the pointers point into stay alive with the model.
        self._keep = [p for p in model.parameters()] + [
            getattr(m, "packed", None) or getattr(m, "quant", None) for m in model.modules()]
        self._driver = self._build_driver()
        self._driver_caches: Optional[tuple] = None  # (decode fn, cache pointers) the layer structs hold

    def _build_driver(self) -> Any:
        """The one-call decode step (module doc), or None when a piece is missing."""
        lib = native.build("decoder_step", _DRIVER_SOURCE, signatures=_DRIVER_SIGNATURES)
        lins = [[lin_struct(w) if w is not None else Lin() for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
                for layer in self.layers]
        moes = [layer.moe.native if layer.moe is not None else None for layer in self.layers]
        moe_lib = load_moe() if any(layer.moe is not None for layer in self.layers) else None
        if lib is None or any(lin is None for row in lins for lin in row) or any(
                layer.moe is not None and (moe is None or moe_lib is None)
                for layer, moe in zip(self.layers, moes, strict=True)):
            return None
        dims = {(layer.num_heads, layer.num_kv_heads, layer.head_dim, row[0].n)  # same shapes everywhere
                for layer, row in zip(self.layers, lins, strict=True)}
        kinds = {lin.kind for row in lins for lin in row}
        i8lib = i8gemm.load() if 2 in kinds else None
        if len(dims) != 1 or (self._qgemm is None and 1 in kinds) or (i8lib is None and 2 in kinds):
            return None
        self._fns = Fns(address(self._gemm), address(self._qgemm) if self._qgemm is not None else None,
                         address(self._norm), address(self._rotary), address(self._silu), address(self._decode),
                         address(i8lib.i8gemm_f32) if i8lib is not None else None)
        lora_lib = lora_kernels.load()
        self._fns.lora = address(lora_lib.lora_add_f32) if lora_lib is not None else None
        self._fns.moe = address(moe_lib.moe_forward_f32) if moe_lib is not None else None
        self._fns.gemm_panels = address(self._gemm_lib.gemm_panels_f32)
        self._fns.gelu, self._fns.head_norm = address(self._gelu), address(self._head_norm)
        if self._qgemm is not None:
            set_qgemm(self._fns, qgemm.load())
        self._layers_c = (_LayerC * len(self.layers))(*[
            _LayerC(layer.norm1, layer.norm2, *row, None, None, layer.window, layer.eps, layer.scale,
                    ctypes.addressof(moe.struct) if moe is not None else None, layer.q_norm or None,
                    layer.k_norm or None, layer.norm3 or None, layer.norm4 or None, layer.gelu, layer.local,
                    layer.qk_eps, layer.cap)
            for layer, row, moe in zip(self.layers, lins, moes, strict=True)])
        inter = max([row[3].k for row, moe in zip(lins, moes, strict=True) if moe is None], default=0)
        self._scratch_per_token = 3 * self.hidden_size + lins[0][0].n \
            + self.layers[0].num_heads * self.layers[0].head_dim + 3 * inter  # decoder_decode's buffers
        return lib.decoder_decode

    @classmethod
    def try_build(cls, model: Any) -> Optional["NativeDecoder"]:
        """The native decoder of a finalized model, or None if any piece is missing."""
        from workers.model.attention.torch_backend import TorchAttentionBackend
        from workers.model.linear import Linear

        if getattr(model, "tp", None) is not None or getattr(model, "compiled", None) is not None:
            return None
        weight = model.model.norm.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return None
        linears = [m for m in model.model.modules() if isinstance(m, Linear)]
        if not linears or any(m.quant is None and (m.backend != "native" or m.packed is None) for m in linears):
            return None
        backends = {id(layer.self_attn.attn_backend) for layer in model.model.layers}
        backend = model.model.layers[0].self_attn.attn_backend
        if len(backends) != 1 or not isinstance(backend, TorchAttentionBackend) or backend.batch_invariant:
            return None
        attn = model.model.layers[0].self_attn
        if any(not isinstance(layer.mlp, SparseMoE) and not hasattr(layer.mlp, "gate_up_proj")
               for layer in model.model.layers):  # an MLP it does not know
            return None
        if attn.num_heads % attn.num_kv_heads or attn.num_heads // attn.num_kv_heads > cpu_decode.MAX_GROUP \
                or attn.head_dim > cpu_decode.MAX_DIM:
            return None
        ops, gemm_lib, attn_lib = cpu_ops.load(), gemm.load(), cpu_decode.load()
        if ops is None or gemm_lib is None or attn_lib is None:
            return None
        if any(m.quant is not None for m in linears) and qgemm.load() is None:
            return None
        return cls(model, ops, gemm_lib, attn_lib)

    # ------------------------------------------------------------------ kernels
    def _linear(self, x: torch.Tensor, weight: tuple, lora: Any = None) -> torch.Tensor:
        n, k = weight[-2], weight[-1]
        y = torch.empty(x.shape[0], n)
        if self.timers is not None:
            begin = time.perf_counter()
        if weight[0] is None:
            _, panels, bias, n, k = weight
            self._gemm(x.data_ptr(), x.shape[0], k, x.stride(0), panels, n, bias or None, y.data_ptr(), n)
        elif weight[1] is None:
            y = weight[0].matmul(x)
        else:
            quant, q, scales, mins, bias, n, k = weight
            self._qgemm(x.data_ptr(), x.shape[0], k, x.stride(0), q, scales, mins or None, quant.bits,
                        quant.group_size, n, bias or None, y.data_ptr(), n)
        if lora is not None:
            lora.add_to(x, y)
        if self.timers is not None:
            self.timers["linear"] += time.perf_counter() - begin
        return y

    def _add_norm(self, x: Optional[torch.Tensor], residual: torch.Tensor, weight: int, eps: float) -> torch.Tensor:
        out = torch.empty_like(residual)
        self._norm(x.data_ptr() if x is not None else None, residual.data_ptr(), weight, out.data_ptr(),
                   residual.shape[0], self.hidden_size, eps)
        return out

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: Any) -> torch.Tensor:
        model = self.model.model
        x = model.embed_tokens(input_ids)
        x = (x * self.embed_scale if self.embed_scale is not None else x).contiguous()  # as GemmaModel
        cos, sin = model.rotary_emb.lookup(positions)
        local = getattr(model, "rotary_emb_local", None)
        cos_l, sin_l = local.lookup(positions) if local is not None else (cos, sin)
        tokens = x.shape[0]
        decode_only = (meta.num_decodes == meta.num_requests and self._backend._native_decode
                       and kv_caches[0].shape[2] <= cpu_decode.MAX_BLOCK)
        if decode_only and kv_caches[0].dtype == torch.int8:  # kv_cache_dtype int8 (attention/kv_int8.py)
            if self._decode_int8 is None:
                int8_lib = cpu_decode.load(torch.int8)
                self._decode_int8 = int8_lib.paged_decode_f32 if int8_lib is not None else False
            decode_only = self._decode_int8 is not False
            decode_fn = self._decode_int8
        else:
            decode_fn = self._decode
        if decode_only:
            tails = meta.tree_tails
            step = (meta.slot_mapping.data_ptr(), meta.block_tables.data_ptr(), meta.block_tables.shape[1],
                    meta.seq_lens.data_ptr(), meta.num_requests,
                    *((tails[0].data_ptr(), tails[1].data_ptr(), tails[1].shape[1]) if tails else (None, None, 0)))
        ropes = (cos.data_ptr(), sin.data_ptr(), cos_l.data_ptr(), sin_l.data_ptr())
        capture = self.aux_capture() if self.aux_capture is not None else None
        if decode_only and self._driver is not None and self.timers is None and self._lora_in_driver():
            return self._decode_step(x, kv_caches, decode_fn, ropes, step, capture)
        residual = x
        hidden = self._add_norm(None, residual, self.layers[0].norm1, self.layers[0].eps)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if i:
                hidden = self._add_norm(hidden, residual, layer.norm1, layer.eps)  # residual += hidden
            if capture is not None:
                capture.native_layer(i, residual)
            qkv = self._linear(hidden, layer.qkv, layer.linears[0].lora)
            hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
            ld = qkv.stride(0)
            if layer.q_norm:  # per head, in place, before the rotation
                self._head_norm(qkv.data_ptr(), tokens, hq, d, ld, layer.q_norm, layer.qk_eps)
                self._head_norm(qkv.data_ptr() + hq * d * 4, tokens, hkv, d, ld, layer.k_norm, layer.qk_eps)
            self._rotary(qkv.data_ptr(), tokens, hq + hkv, d, ld, *ropes[2 * layer.local : 2 * layer.local + 2])
            if self.timers is not None:
                begin = time.perf_counter()
            if decode_only:
                attn = torch.empty(tokens, hq * d)
                base = qkv.data_ptr()
                k_base = base + hq * d * 4
                cache = kv_cache.data_ptr()
                slots, tables, width, lens, num_reqs, tail_lo, tail_slots, tail_width = step
                decode_fn(base, ld, k_base, ld, k_base + hkv * d * 4, ld, slots, cache,
                             cache + kv_cache.stride(0) * kv_cache.element_size(), tables, width, lens, num_reqs, hq, hkv, d,
                             kv_cache.shape[2], layer.scale, layer.window, attn.data_ptr(), hq * d,
                             tail_lo, tail_slots, tail_width, layer.cap)
            else:
                q = qkv[:, : hq * d].view(tokens, hq, d)
                k = qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)
                v = qkv[:, (hq + hkv) * d :].view(tokens, hkv, d)
                attn = layer.attn.attn_backend.forward(q, k, v, kv_cache, meta, layer.scale, layer.window or None,
                                                       **layer.attn.backend_kwargs).reshape(tokens, hq * d)
            if self.timers is not None:
                self.timers["attention"] += time.perf_counter() - begin
            out = self._linear(attn, layer.o, layer.linears[1].lora)
            if layer.norm3:  # Gemma: residual += norm2(out), then the MLP's input norm
                out = self._add_norm(None, out, layer.norm2, layer.eps)
            hidden = self._add_norm(out, residual, layer.norm3 or layer.norm2, layer.eps)
            if layer.moe is not None:  # the module: one C call for the routed experts where native
                hidden = layer.moe(hidden)
                continue
            gate_up = self._linear(hidden, layer.gate_up, layer.linears[2].lora)
            act = torch.empty(tokens, gate_up.shape[1] // 2)
            (self._gelu if layer.gelu else self._silu)(gate_up.data_ptr(), act.data_ptr(), tokens, act.shape[1])
            hidden = self._linear(act, layer.down, layer.linears[3].lora)
            if layer.norm4:  # Gemma: the MLP's output normed before it joins the stream
                hidden = self._add_norm(None, hidden, layer.norm4, layer.eps)
        return self._add_norm(hidden, residual, self.final_norm, self.final_eps)

    def _lora_in_driver(self) -> bool:
        """Points the one-call step at this step's adapter rows (none: it skips
        the side paths) and each linear at its side paths; False when one is
        not the grouped kernel's (the per-layer loop then runs the step)."""
        batch = next((lin.lora.batch for layer in self.layers for lin in layer.linears
                      if lin is not None and lin.lora is not None), None)
        self._fns.lora_rows = None
        if batch is None or not batch.groups:
            return True
        if not self._fns.lora:
            return False
        for layer, layer_c in zip(self.layers, self._layers_c, strict=True):
            for lin, lin_c in zip(layer.linears, (layer_c.qkv, layer_c.o, layer_c.gate_up, layer_c.down), strict=True):
                if lin is not None and lin.lora is not None and lin.lora.slots:  # not the grouped kernel's
                    return False
                grouped = lin.lora.grouped if lin is not None and lin.lora is not None else None
                lin_c.lora = ctypes.addressof(grouped.c) if grouped is not None else None
        self._fns.lora_rows = ctypes.addressof(batch.rows.c)
        return True

    def _decode_step(self, x: torch.Tensor, kv_caches: list[torch.Tensor], decode_fn: Any, ropes: tuple,
                     step: tuple, capture: Any = None) -> torch.Tensor:
        """A decode-only step in one C call (module doc); same kernels, same order, same bits.
        With an EAGLE-3 ``capture``, the call also copies the stream entering its layers."""
        caches = (address(decode_fn), tuple(c.data_ptr() for c in kv_caches))
        if caches != self._driver_caches:  # the first step, or a new cache
            self._fns.decode = caches[0]
            for layer_c, cache in zip(self._layers_c, kv_caches, strict=True):
                layer_c.k_cache = cache.data_ptr()
                layer_c.v_cache = cache.data_ptr() + cache.stride(0) * cache.element_size()
            self._driver_caches = caches
        tokens = x.shape[0]
        out = torch.empty_like(x)
        scratch = torch.empty(tokens * self._scratch_per_token)
        layer = self.layers[0]
        slots, tables, width, lens, num_reqs, tail_lo, tail_slots, tail_width = step
        cap_layers, features = None, None
        if capture is not None:
            cap_layers = (ctypes.c_long * len(capture.layer_ids))(*capture.layer_ids)
            features = torch.empty(len(capture.layer_ids), tokens, self.hidden_size)
        self._driver(ctypes.byref(self._fns), self._layers_c, len(self.layers), tokens, self.hidden_size,
                     layer.num_heads, layer.num_kv_heads, layer.head_dim, x.data_ptr(), out.data_ptr(),
                     self.final_norm, self.final_eps, *ropes, slots, tables, width, lens, num_reqs,
                     kv_caches[0].shape[2], scratch.data_ptr(), tail_lo, tail_slots, tail_width,
                     cap_layers, len(capture.layer_ids) if capture is not None else 0,
                     features.data_ptr() if features is not None else None)
        if capture is not None:
            capture.native_step(features)
        return out
