"""Writing GPTQ / AWQ checkpoints from a float model (``prefixserve quantize``,
``bench quant``): calibration on the float model, then
``workers/model/quant/checkpoints.write_checkpoint``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CALIBRATION_TOKENS = 4096


def quantize_checkpoint(src: Path, dst: Path, method: str, group_size: int,
                        calibration_tokens: int = CALIBRATION_TOKENS, rtn: bool = False) -> dict[str, Any]:
    """Writes the float model in ``src`` as a ``method`` (gptq | awq | w8a8) checkpoint
    in ``dst``: GPTQ or AWQ calibrated on ``calibration_tokens`` tokens of the
    calibration text, or round to nearest with ``rtn``; w8a8: SmoothQuant as
    ``quantization="w8a8"`` does it at load (its own 4096 calibration tokens).

    Returns: ``write_checkpoint``'s summary.
    """
    from workers.model.loader import iter_weights
    from workers.model.quant.checkpoint_writer import write_checkpoint, write_w8a8_checkpoint

    if method == "w8a8":  # SmoothQuant as quantization="w8a8" runs it at load, written out
        from workers.model.attention.torch_backend import TorchAttentionBackend
        from workers.model.loader import load_model

        model, _ = load_model(src, "float32", "cpu", TorchAttentionBackend(), quantization="w8a8")
        return write_w8a8_checkpoint(iter_weights(src), model, src, dst)
    stats = None if rtn else calibration_statistics(src, calibration_tokens, method)
    return write_checkpoint(iter_weights(src), src, dst, method, group_size,
                            hessians=stats if method == "gptq" else None, awq_stats=stats if method == "awq" else None)


def calibration_statistics(src: Path, calibration_tokens: int, method: str) -> dict[str, Any]:
    """What ``method`` calibrates on, for every decoder linear layer of the float
    model in ``src``, by checkpoint layer name (fused projections share theirs):
    GPTQ's input Hessian, or AWQ's ``(X^T X / n, mean |x|)``."""
    import time

    from workers.model.attention.torch_backend import TorchAttentionBackend
    from workers.model.loader import _calibration_ids, load_model
    from workers.model.quant.smoothquant import input_statistics

    ids = _calibration_ids(src)
    if not ids:
        raise ValueError(f"{method} calibrates on text: {src} needs a tokenizer.json (or round to nearest: --rtn)")
    if calibration_tokens < 2:
        raise ValueError(f"--calibration-tokens must be at least 2, got {calibration_tokens}")
    started = time.monotonic()
    model, _ = load_model(src, "float32", "cpu", TorchAttentionBackend(), linear_backend="torch")
    by_module = input_statistics(model, ids, calibration_tokens)
    if method == "gptq":  # its Hessian, 2 X^T X / n
        by_module = {m: 2 * xtx for m, (xtx, _) in by_module.items()}
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
