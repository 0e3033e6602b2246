"""``prefixserve quantize``: write a 4-bit GPTQ or AWQ checkpoint from a float model.

    prefixserve quantize --method gptq --output /tmp/smol-gptq
    prefixserve generate "Hello" --model /tmp/smol-gptq        # loaded as gptq (config.json says so)

Every decoder linear layer is quantized asymmetrically per group of
``--group-size`` inputs on GPTQ's grid (float16 scales, integer zero points)
and written in the method's standard layout
(``workers/model/quant/checkpoints.py``: GPTQ v1 packing with ``g_idx``,
AutoAWQ's GEMM packing); embeddings, norms and the LM head are copied.

``--method gptq`` runs the GPTQ algorithm (``workers/model/quant/gptq.py``):
one float pass over ``--calibration-tokens`` tokens of the calibration text
shipped with Python (``cluster/shared/text_corpus.py``) gives each layer's
input Hessian, and each weight column's rounding error is spread over the
columns not yet quantized. ``--rtn`` (and ``--method awq``, whose activation
-aware scale search is not implemented) rounds to nearest on the same grid.
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
                        help="calibration text tokens of GPTQ's Hessians")
    parser.add_argument("--rtn", action="store_true", help="round to nearest instead of GPTQ")


def run_quantize(args: argparse.Namespace) -> int:
    from workers.model.loader import iter_weights, resolve_model
    from workers.model.quant.checkpoints import QuantSpec, write_checkpoint

    src = resolve_model(args.model)
    if QuantSpec.from_config(src) is not None:
        raise ValueError(f"{src} is already quantized: pass a float model")
    dst = Path(args.output)
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"{dst} exists and is not empty: pass a new --output folder")
    hessians = None
    if args.method == "gptq" and not args.rtn:
        hessians = layer_hessians(src, args.calibration_tokens)
    result = write_checkpoint(iter_weights(src), src, dst, args.method, args.group_size, hessians)
    how = f"GPTQ on {result['gptq_layers']} of them" if hessians else "rounded to nearest"
    print(f"{dst}: {result['layers']} layers as {args.method} (group {args.group_size}), {how}, "
          f"{result['bytes'] / 2**20:.1f} MiB")  # the command's output
    return 0


def layer_hessians(src: Path, calibration_tokens: int) -> dict[str, Any]:
    """The input Hessian of every decoder linear layer of the float model in
    ``src``, by checkpoint layer name (fused projections share theirs)."""
    import time

    from workers.model.attention.torch_backend import TorchAttentionBackend
    from workers.model.loader import _calibration_ids, load_model
    from workers.model.quant.gptq import hessians

    ids = _calibration_ids(src)
    if not ids:
        raise ValueError(f"GPTQ calibrates on text: {src} needs a tokenizer.json (or pass --rtn)")
    if calibration_tokens < 2:
        raise ValueError(f"--calibration-tokens must be at least 2, got {calibration_tokens}")
    started = time.monotonic()
    model, _ = load_model(src, "float32", "cpu", TorchAttentionBackend(), linear_backend="torch")
    by_module = hessians(model, ids, calibration_tokens)
    out: dict[str, Any] = {}
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            out[f"{prefix}self_attn.{name}"] = by_module[attn.qkv_proj]
        out[f"{prefix}self_attn.o_proj"] = by_module[attn.o_proj]
        out[f"{prefix}mlp.gate_proj"] = out[f"{prefix}mlp.up_proj"] = by_module[mlp.gate_up_proj]
        out[f"{prefix}mlp.down_proj"] = by_module[mlp.down_proj]
    logger.info("GPTQ: Hessians of %d layers from %d calibration tokens in %.1f s", len(out),
                min(calibration_tokens, len(ids)), time.monotonic() - started)
    return out
