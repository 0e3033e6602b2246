"""W8A8 with SmoothQuant (``quantization="w8a8"``): int8 weights with one scale
per output channel, int8 activations with one scale per token computed at run
time, and the smoothing of Xiao et al. (2023) that moves activation outliers
into the weights first.

Calibration runs the float model over ``calibration_tokens`` of the
calibration text (``cluster/shared/text_corpus.py``) and records every linear
layer's per-input-channel max |x|. With ``alpha`` (0.5), input channel j of a
layer gets ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)``; X is divided and W
multiplied by s, folded into what produces X so nothing is added at run time:

    qkv_proj    <- input_layernorm's weight
    gate_up     <- post_attention_layernorm's weight
    down_proj   <- the up half of gate_up (silu(gate) * up is linear in up)
    o_proj      <- v's rows (attention output is linear in V); with grouped
                   query attention one s per KV-head channel (the max over
                   the query heads sharing it)

At run time each layer quantizes its input per token and multiplies int8 by
int8 with integer dot-product instructions (``i8gemm.py``: AVX-512 VNNI or
AVX2), exactly in int32, then scales by the token's and the channel's scale.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch


logger = logging.getLogger(__name__)

ALPHA = 0.5
CALIBRATION_TOKENS = 4096
WINDOW = 256


def calibrate(model: Any, token_ids: list[int], num_tokens: int = CALIBRATION_TOKENS) -> dict[Any, torch.Tensor]:
    """Per linear layer: the max |x| of each input channel over ``num_tokens``
    calibration tokens (windows of ``WINDOW``, each on a fresh KV cache)."""
    stats: dict[Any, torch.Tensor] = {}

    def record(module: Any, x: torch.Tensor) -> None:
        amax = x.abs().amax(dim=0)
        stats[module] = torch.maximum(stats[module], amax) if module in stats else amax

    start = time.monotonic()
    n = run_calibration(model, token_ids, num_tokens, record)
    logger.info("w8a8: calibrated on %d tokens in %.1f s", n, time.monotonic() - start)
    return stats


def input_statistics(model: Any, token_ids: list[int],
                     num_tokens: int) -> dict[Any, tuple[torch.Tensor, torch.Tensor]]:
    """Per decoder linear layer: ``(X^T X / n, mean |x| per input channel)`` (float64)
    of its inputs over ``num_tokens`` calibration tokens (GPTQ's Hessian is twice
    the first, AWQ searches with both)."""
    sums: dict[Any, list] = {}

    def record(module: Any, x: torch.Tensor) -> None:
        x = x.double()
        if module not in sums:
            sums[module] = [x.T @ x, x.abs().sum(dim=0), x.shape[0]]
        else:
            entry = sums[module]
            entry[0].addmm_(x.T, x)
            entry[1] += x.abs().sum(dim=0)
            entry[2] += x.shape[0]

    run_calibration(model, token_ids, num_tokens, record)
    return {m: (h / n, a / n) for m, (h, a, n) in sums.items()}


def run_calibration(model: Any, token_ids: list[int], num_tokens: int, record: Any) -> int:
    """Runs the float model (module path) over ``num_tokens`` of ``token_ids`` in
    windows of ``WINDOW`` tokens, each on a fresh KV cache, calling
    ``record(linear, x)`` with every decoder linear layer's input rows
    ``x [T, in_features]`` (the LM head left out). Returns the tokens run."""
    from workers.model.attention.base import AttentionMetadata
    from workers.model.linear import Linear

    hooks = [m.register_forward_pre_hook(lambda module, inputs: record(
        module, inputs[0].detach().reshape(-1, inputs[0].shape[-1]))) for m in model.modules()
        if isinstance(m, Linear) and m is not model.lm_head]
    arch = model.arch
    block = 16
    blocks = -(-WINDOW // block)
    dtype = next(model.parameters()).dtype
    caches = [torch.zeros(2, blocks, block, arch.num_key_value_heads, arch.head_dim, dtype=dtype)
              for _ in range(arch.num_hidden_layers)]
    ids = token_ids[:num_tokens]
    try:
        with torch.inference_mode():
            for i in range(0, len(ids) - 1, WINDOW):
                window = ids[i : i + WINDOW]
                n = len(window)
                meta = AttentionMetadata.build(list(range(n)), [n], [n], [list(range(-(-n // block)))])
                model(torch.tensor(window), torch.arange(n), caches, meta)
    finally:
        for hook in hooks:
            hook.remove()
    return len(ids)


def smooth(model: Any, stats: dict[Any, torch.Tensor], alpha: float = ALPHA) -> None:
    """Folds the smoothing factors into the model's weights (see the module doc)."""
    arch = model.arch
    with torch.no_grad():
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            s = _factors(stats[attn.qkv_proj], attn.qkv_proj.weight, alpha)
            attn.qkv_proj.weight.mul_(s)
            layer.input_layernorm.weight.div_(s)
            s = _factors(stats[mlp.gate_up_proj], mlp.gate_up_proj.weight, alpha)
            mlp.gate_up_proj.weight.mul_(s)
            layer.post_attention_layernorm.weight.div_(s)
            inter = mlp.down_proj.in_features
            s = _factors(stats[mlp.down_proj], mlp.down_proj.weight, alpha)
            mlp.down_proj.weight.mul_(s)
            mlp.gate_up_proj.weight[inter:].div_(s[:, None])
            if mlp.gate_up_proj.bias is not None:
                mlp.gate_up_proj.bias[inter:].div_(s)
            _smooth_o_through_v(attn, stats[attn.o_proj], arch, alpha)


def _factors(act_max: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    w_max = weight.abs().amax(dim=0).clamp_min(1e-5)
    s = act_max.clamp_min(1e-5).pow(alpha) / w_max.pow(1 - alpha)
    return s.clamp(1e-2, 1e2)


def _smooth_o_through_v(attn: Any, act_max: torch.Tensor, arch: Any, alpha: float) -> None:
    heads, kv_heads, dim = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    group = heads // kv_heads
    # o_proj input channel (h, d) reads V row (h // group, d): one factor per (kv head, d).
    act = act_max.view(kv_heads, group, dim).amax(dim=1)
    w_max = attn.o_proj.weight.abs().amax(dim=0).view(kv_heads, group, dim).amax(dim=1)
    s_kv = (act.clamp_min(1e-5).pow(alpha) / w_max.clamp_min(1e-5).pow(1 - alpha)).clamp(1e-2, 1e2)  # [kv, d]
    v_first = heads * dim + kv_heads * dim
    qkv = attn.qkv_proj
    qkv.weight[v_first : v_first + kv_heads * dim].div_(s_kv.reshape(-1, 1))
    if qkv.bias is not None:
        qkv.bias[v_first : v_first + kv_heads * dim].div_(s_kv.reshape(-1))
    attn.o_proj.weight.mul_(s_kv[:, None, :].expand(kv_heads, group, dim).reshape(1, -1))


def quantize_per_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8, one scale per output channel: ``(q [N, K] int8, scales [N])``."""
    scale = np.abs(w).max(axis=1) / np.float32(127)
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32)
