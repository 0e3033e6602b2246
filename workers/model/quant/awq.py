"""AWQ (Lin et al., 2024) for ``prefixserve quantize --method awq``: per-channel
scales that protect the weights of salient input channels before rounding.

Input channel ``j`` of the layers that share an input is multiplied by
``s_j = mean|x_j|^a`` (normalized by ``sqrt(max s * min s)``) and the producer
of that input divided by it, which changes nothing in float; the rounded
weights ``Q(W diag(s))`` then keep more precision where activations are large.
``a`` is searched over a grid of 20 values in [0, 1) per layer, minimizing the
output error on the calibration inputs, ``sum over rows of d H d^T`` with
``d = W - Q(W diag(s)) diag(s)^-1`` and ``H = X^T X`` (so ``a = 0``, plain
rounding, is always a candidate). Folded as AutoAWQ does:

    q / k / v     <- input_layernorm's weight
    gate / up     <- post_attention_layernorm's weight
    down          <- up's rows (and bias): silu(gate) * up is linear in up
    o             not scaled under grouped-query attention (v's rows serve
                  several query heads); otherwise <- v's rows (and bias)

Rounding is GPTQ's grid (``gptq.rtn``), which the AWQ layout stores exactly.
AutoAWQ's clipping search is not done.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from workers.model.quant import gptq

logger = logging.getLogger(__name__)

GRID = 20


def search_scales(weights: list[np.ndarray], h: torch.Tensor, act_mean: torch.Tensor, group_size: int) -> torch.Tensor:
    """The input-channel scales (float64 ``[K]``) for ``weights`` (each ``[N_i, K]``, one shared input) that
    minimize the rounded layers' output error (module doc)."""
    w = torch.from_numpy(np.concatenate([np.asarray(x, dtype=np.float32) for x in weights])).double()
    h = h.double()
    best_err, best = float("inf"), torch.ones(w.shape[1], dtype=torch.float64)
    for i in range(GRID):
        s = act_mean.double().clamp_min(1e-4).pow(i / GRID)
        s = s / (s.max() * s.min()).sqrt()
        scaled = (w * s).float().numpy()
        d = w - torch.from_numpy(gptq.rtn(scaled, group_size).dequantize()).double() / s
        err = float(((d @ h) * d).sum())
        if err < best_err:
            best_err, best = err, s
    return best


def apply(tensors: dict[str, torch.Tensor], stats: dict[str, tuple[torch.Tensor, torch.Tensor]], num_layers: int,
          group_size: int, grouped_query: bool) -> int:
    """Scales the checkpoint's ``tensors`` in place (module doc); ``stats`` by layer name
    (``model.layers.3.self_attn.q_proj``). Returns the number of scaled layer groups."""
    scaled = 0

    def scale(names: list[str], producer: list[str], key: str) -> None:
        nonlocal scaled
        h, act = stats[key]
        s = search_scales([tensors[f"{n}.weight"].float().numpy() for n in names], h, act, group_size)
        for n in names:
            tensors[f"{n}.weight"] = (tensors[f"{n}.weight"].double() * s).to(tensors[f"{n}.weight"].dtype)
        for p in producer:  # a norm's weight, or a layer's output rows (and bias)
            t = tensors[p]
            shape = (-1,) + (1,) * (t.dim() - 1)
            tensors[p] = (t.double() / s.view(shape)).to(t.dtype)
        scaled += 1

    for i in range(num_layers):
        p = f"model.layers.{i}."
        attn = [f"{p}self_attn.{x}_proj" for x in "qkv"]
        scale(attn, [f"{p}input_layernorm.weight"], attn[0])
        mlp = [f"{p}mlp.gate_proj", f"{p}mlp.up_proj"]
        scale(mlp, [f"{p}post_attention_layernorm.weight"], mlp[0])
        up = [f"{p}mlp.up_proj.weight"] + ([f"{p}mlp.up_proj.bias"] if f"{p}mlp.up_proj.bias" in tensors else [])
        scale([f"{p}mlp.down_proj"], up, f"{p}mlp.down_proj")
        if not grouped_query:
            v = [f"{p}self_attn.v_proj.weight"] + (
                [f"{p}self_attn.v_proj.bias"] if f"{p}self_attn.v_proj.bias" in tensors else [])
            scale([f"{p}self_attn.o_proj"], v, f"{p}self_attn.o_proj")
        if (i + 1) % 5 == 0:
            logger.info("AWQ: searched the scales of %d of %d layers", i + 1, num_layers)
    logger.info("AWQ: scaled %d layer groups", scaled)
    return scaled
