"""``prefixserve quantize``: write a 4-bit GPTQ or AWQ checkpoint from a float model.

    prefixserve quantize --method gptq --output /tmp/smol-gptq
    prefixserve generate "Hello" --model /tmp/smol-gptq        # loaded as gptq (config.json says so)

Every decoder linear layer is quantized asymmetrically per group of
``--group-size`` inputs on GPTQ's grid (float16 scales, integer zero points)
and written in the method's standard layout
(``workers/model/quant/checkpoints.py``: GPTQ v1 packing with ``g_idx``,
AutoAWQ's GEMM packing); embeddings, norms and the LM head are copied.

One float pass over ``--calibration-tokens`` tokens of the calibration text
shipped with Python (``cluster/shared/text_corpus.py``) gives each layer's
input statistics. ``--method gptq`` runs GPTQ (``workers/model/quant/gptq.py``):
each weight column's rounding error is spread over the columns not yet
quantized. ``--method awq`` runs AWQ's scale search
(``workers/model/quant/awq.py``): per-input-channel scales folded into the
norms and producer rows, then rounding. ``--rtn`` rounds to nearest only.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def add_quantize_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="float model folder or .gguf (default: the default model)")
    parser.add_argument("--method", choices=["gptq", "awq"], required=True, help="checkpoint layout to write")
    parser.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128], help="inputs per group")
    parser.add_argument("--output", required=True, help="folder to write (created)")
    parser.add_argument("--calibration-tokens", type=int, default=4096,
                        help="calibration text tokens (GPTQ's Hessians, AWQ's statistics)")
    parser.add_argument("--rtn", action="store_true", help="round to nearest, without calibration")


def run_quantize(args: argparse.Namespace) -> int:
    from workers.model.loader import iter_weights, resolve_model
    from workers.model.quant.checkpoints import QuantSpec, write_checkpoint

    src = resolve_model(args.model)
    if QuantSpec.from_config(src) is not None:
        raise ValueError(f"{src} is already quantized: pass a float model")
    dst = Path(args.output)
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"{dst} exists and is not empty: pass a new --output folder")
    hessians = awq_stats = None
    if not args.rtn:
        stats = layer_statistics(src, args.calibration_tokens, args.method)
        hessians, awq_stats = (stats, None) if args.method == "gptq" else (None, stats)
    result = write_checkpoint(iter_weights(src), src, dst, args.method, args.group_size, hessians, awq_stats)
    how = (f"GPTQ on {result['gptq_layers']} of them" if hessians else "AWQ-scaled, rounded to nearest"
           if awq_stats else "rounded to nearest")
    print(f"{dst}: {result['layers']} layers as {args.method} (group {args.group_size}), {how}, "
          f"{result['bytes'] / 2**20:.1f} MiB")  # the command's output
    return 0


def layer_statistics(src: Path, calibration_tokens: int, method: str) -> dict[str, Any]:
    """What ``method`` calibrates on, for every decoder linear layer of the float
    model in ``src``, by checkpoint layer name (fused projections share theirs):
    GPTQ's input Hessian, or AWQ's ``(X^T X / n, mean |x|)``."""
    import time

    from workers.model.attention.torch_backend import TorchAttentionBackend
    from workers.model.loader import _calibration_ids, load_model
    from workers.model.quant import awq, gptq

    ids = _calibration_ids(src)
    if not ids:
        raise ValueError(f"{method} calibrates on text: {src} needs a tokenizer.json (or pass --rtn)")
    if calibration_tokens < 2:
        raise ValueError(f"--calibration-tokens must be at least 2, got {calibration_tokens}")
    started = time.monotonic()
    model, _ = load_model(src, "float32", "cpu", TorchAttentionBackend(), linear_backend="torch")
    by_module = (gptq.hessians if method == "gptq" else awq.statistics)(model, ids, calibration_tokens)
    out: dict[str, Any] = {}
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            out[f"{prefix}self_attn.{name}"] = by_module[attn.qkv_proj]
        out[f"{prefix}self_attn.o_proj"] = by_module[attn.o_proj]
        out[f"{prefix}mlp.gate_proj"] = out[f"{prefix}mlp.up_proj"] = by_module[mlp.gate_up_proj]
        out[f"{prefix}mlp.down_proj"] = by_module[mlp.down_proj]
    logger.info("%s: statistics of %d layers from %d calibration tokens in %.1f s", method, len(out),
                min(calibration_tokens, len(ids)), time.monotonic() - started)
    return out
