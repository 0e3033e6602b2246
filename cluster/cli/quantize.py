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
norms and producer rows, then rounding. ``--rtn`` rounds to nearest only;
``--method int4`` is the same as ``--method gptq --rtn`` (int4 weights in
the GPTQ layout, which every GPTQ reader loads).
``--method w8a8`` writes SmoothQuant's int8 weights (what
``quantization="w8a8"`` computes at load) in compressed-tensors' W8A8 format,
which vLLM reads too.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def add_quantize_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="float model folder or .gguf (default: the default model)")
    parser.add_argument("--method", choices=["gptq", "awq", "int4", "w8a8"], required=True,
                        help="checkpoint to write: gptq / awq (4-bit, calibrated), int4 (4-bit rounded to nearest, "
                             "GPTQ layout), w8a8 (SmoothQuant int8, compressed-tensors)")
    parser.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128], help="inputs per group")
    parser.add_argument("--output", required=True, help="folder to write (created)")
    parser.add_argument("--calibration-tokens", type=int, default=4096,
                        help="calibration text tokens (GPTQ's Hessians, AWQ's statistics)")
    parser.add_argument("--rtn", action="store_true", help="round to nearest, without calibration")


def run_quantize(args: argparse.Namespace) -> int:
    from workers.model.loader import resolve_model
    from workers.model.quant.checkpoints import QuantSpec
    from workers.quantize import quantize_checkpoint

    src = resolve_model(args.model)
    if QuantSpec.from_config(src) is not None:
        raise ValueError(f"{src} is already quantized: pass a float model")
    dst = Path(args.output)
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"{dst} exists and is not empty: pass a new --output folder")
    method, rtn = ("gptq", True) if args.method == "int4" else (args.method, args.rtn)
    result = quantize_checkpoint(src, dst, method, args.group_size, args.calibration_tokens, rtn)
    if args.method == "w8a8":
        print(f"{dst}: {result['layers']} layers as w8a8 (SmoothQuant int8 per channel, compressed-tensors), "
              f"{result['bytes'] / 2**20:.1f} MiB")  # the command's output
        return 0
    how = ("rounded to nearest" if rtn else f"GPTQ on {result['gptq_layers']} of them" if method == "gptq"
           else "AWQ-scaled, rounded to nearest")
    print(f"{dst}: {result['layers']} layers as {method} (group {args.group_size}), {how}, "
          f"{result['bytes'] / 2**20:.1f} MiB")  # the command's output
    return 0
