"""``prefixserve quantize``: write a 4-bit GPTQ or AWQ checkpoint from a float model.

    prefixserve quantize --method gptq --output /tmp/smol-gptq
    prefixserve generate "Hello" --model /tmp/smol-gptq        # loaded as gptq (config.json says so)

Every decoder linear layer is quantized asymmetrically per group of
``--group-size`` inputs by rounding to nearest (the grid ``int4`` uses), and
written in the method's standard layout (``workers/model/quant/checkpoints.py``:
GPTQ v1 packing with ``g_idx``, AutoAWQ's GEMM packing); embeddings, norms and
the LM head are copied. The default model's float weights are a Q4_1 grid, so
group 32 reproduces them exactly.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def add_quantize_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="float model folder or .gguf (default: the default model)")
    parser.add_argument("--method", choices=["gptq", "awq"], required=True, help="checkpoint layout to write")
    parser.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128], help="inputs per group")
    parser.add_argument("--output", required=True, help="folder to write (created)")


def run_quantize(args: argparse.Namespace) -> int:
    from workers.model.loader import iter_weights, resolve_model
    from workers.model.quant.checkpoints import QuantSpec, write_checkpoint

    src = resolve_model(args.model)
    if QuantSpec.from_config(src) is not None:
        raise ValueError(f"{src} is already quantized: pass a float model")
    dst = Path(args.output)
    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"{dst} exists and is not empty: pass a new --output folder")
    result = write_checkpoint(iter_weights(src), src, dst, args.method, args.group_size)
    print(f"{dst}: {result['layers']} layers as {args.method} (group {args.group_size}), "
          f"{result['bytes'] / 2**20:.1f} MiB")  # the command's output
    return 0
