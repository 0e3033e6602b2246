"""Writing quantized checkpoints from a float model (``prefixserve quantize``):
GPTQ and AWQ 4-bit layouts (``write_checkpoint``, packing per
``checkpoints.py``'s table) and compressed-tensors W8A8
(``write_w8a8_checkpoint``). What is written loads back through
``checkpoints.read_checkpoint`` to the very weights the writer quantized."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from workers.model.quant.checkpoints import AWQ_ORDER, LINEAR_SUFFIXES, METHODS
from workers.model.quant.gguf_blocks import DecodedWeight

logger = logging.getLogger(__name__)


def write_w8a8_checkpoint(weights: Iterator[tuple[str, torch.Tensor]], model: Any, src: Path, dst: Path) -> dict[str, Any]:
    """Writes ``model``, loaded from ``src`` with ``quantization="w8a8"`` (smoothed and
    quantized at load), as a compressed-tensors W8A8 checkpoint in ``dst``, in the names
    and order of ``src``'s tensors (``weights``): decoder linear layers as the int8
    rows and scales the model runs, the smoothed norms and biases, the rest as it was.
    Loading the checkpoint therefore runs the same int8 weights as ``quantization="w8a8"``.

    Returns: ``{"layers": n, "bytes": size of the weights written}``.
    """
    from safetensors.torch import save_file

    arch = model.arch
    q_rows, kv_rows = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    rows = {"q_proj": (0, q_rows), "k_proj": (q_rows, q_rows + kv_rows), "v_proj": (q_rows + kv_rows, None),
            "o_proj": (0, None), "down_proj": (0, None)}

    def source(prefix: str) -> tuple[Any, Optional[tuple[int, Optional[int]]]]:
        """The model module holding the checkpoint layer ``prefix``, and its rows (None: not a decoder layer's)."""
        head, _, leaf = prefix.rpartition(".")
        if not head.startswith("model.layers."):
            return None, None
        layer = model.model.layers[int(head.split(".")[2])]
        if leaf in ("input_layernorm", "post_attention_layernorm"):
            return getattr(layer, leaf), (0, None)
        inter = layer.mlp.down_proj.in_features
        modules = {"q_proj": layer.self_attn.qkv_proj, "k_proj": layer.self_attn.qkv_proj,
                   "v_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj,
                   "gate_proj": layer.mlp.gate_up_proj, "up_proj": layer.mlp.gate_up_proj,
                   "down_proj": layer.mlp.down_proj}
        span = {**rows, "gate_proj": (0, inter), "up_proj": (inter, None)}
        return (modules[leaf], span[leaf]) if leaf in modules else (None, None)

    dst.mkdir(parents=True, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    layers = 0
    int8: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # by module: its rows, read back once
    with torch.no_grad():
        for name, tensor in weights:
            prefix, _, part = name.rpartition(".")
            module, span = source(prefix)
            if module is None:
                out[name] = tensor.contiguous()
                continue
            lo, hi = span
            if part == "weight" and prefix.rsplit(".", 1)[-1] in LINEAR_SUFFIXES:
                if id(module) not in int8:
                    int8[id(module)] = module.quant.int8_rows()
                q, scales = int8[id(module)]
                out[name] = torch.from_numpy(np.ascontiguousarray(q[lo:hi]))
                out[f"{prefix}.weight_scale"] = torch.from_numpy(np.ascontiguousarray(scales[lo:hi])).reshape(-1, 1)
                layers += 1
            else:  # a norm's weight or a bias, smoothed
                out[name] = getattr(module, part)[lo:hi].detach().to(tensor.dtype).contiguous()
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False,
                        "group_size": None},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                  "dynamic": True, "group_size": None},
            "output_activations": None}},
        "ignore": ["lm_head"]}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    _copy_extras(src, dst)
    size = (dst / "model.safetensors").stat().st_size
    logger.info("wrote %s: %d layers as W8A8 int8 (compressed-tensors), %.1f MiB", dst, layers, size / 2**20)
    return {"layers": layers, "bytes": size}


def _copy_extras(src: Path, dst: Path) -> None:
    """The folder's other files (tokenizer, generation config) copied beside the new weights."""
    for extra in src.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in ("config.json",) \
                and not extra.name.endswith(".index.json"):
            (dst / extra.name).write_bytes(extra.read_bytes())


# ------------------------------------------------------------------- packing
def _pack_nibbles(values: np.ndarray, axis: int) -> np.ndarray:
    """Eight 4-bit values along ``axis`` into one int32 (value j at bits 4j)."""
    v = np.moveaxis(values.astype(np.uint32), axis, 0)
    v = v.reshape(v.shape[0] // 8, 8, *v.shape[1:])
    packed = np.zeros(v.shape[:1] + v.shape[2:], dtype=np.uint32)
    for j in range(8):
        packed |= v[:, j] << np.uint32(4 * j)
    return np.moveaxis(packed, 0, axis).view(np.int32)


def _awq_pack(values: np.ndarray) -> np.ndarray:
    """[R, N] values -> AWQ's [R, N / 8] int32 (nibble i holds column 8c + AWQ_ORDER[i])."""
    r, n = values.shape
    grouped = values.reshape(r, n // 8, 8)[:, :, list(AWQ_ORDER)]
    return _pack_nibbles(grouped.reshape(r, n), 1)


def pack_layer(decoded: DecodedWeight, method: str) -> dict[str, torch.Tensor]:
    """A 4-bit asymmetric weight in the method's layout. Zeros are the integers
    nearest to ``-min / scale``: exact for GPTQ's grid (``quant/gptq.py``), whose
    zero points are integers and scales float16 values."""
    q = decoded.q.T  # [K, N]
    k, n = q.shape
    if k % 8 or n % 8:
        raise ValueError(f"{method} packs 8 values per int32: {n}x{k} needs both sizes divisible by 8")
    scales = decoded.scales.T.astype(np.float16)  # [G, N]
    zeros = np.clip(np.rint(-decoded.mins.T / np.where(decoded.scales.T == 0, 1, decoded.scales.T)), 0, 15)
    zeros = zeros.astype(np.uint32)
    if method == "gptq":
        return {"qweight": torch.from_numpy(_pack_nibbles(q, 0)),
                "qzeros": torch.from_numpy(_pack_nibbles((zeros - 1) & np.uint32(15), 1)),
                "scales": torch.from_numpy(scales),
                "g_idx": torch.from_numpy((np.arange(k) // decoded.group_size).astype(np.int32))}
    return {"qweight": torch.from_numpy(_awq_pack(q)), "qzeros": torch.from_numpy(_awq_pack(zeros)),
            "scales": torch.from_numpy(scales)}


def write_checkpoint(weights: Iterator[tuple[str, torch.Tensor]], src: Path, dst: Path, method: str,
                     group_size: int, hessians: Optional[dict[str, torch.Tensor]] = None,
                     awq_stats: Optional[dict[str, tuple[torch.Tensor, torch.Tensor]]] = None) -> dict[str, Any]:
    """Writes ``src`` (a float folder; ``weights``: its tensors, ``loader.iter_weights``)
    as a ``method`` checkpoint in ``dst``: every decoder linear layer 4-bit on
    GPTQ's asymmetric grid per group (``quant/gptq.py``), the rest as it was;
    config.json gets the quantization_config.

    Args:
        hessians: By layer name (``model.layers.3.self_attn.q_proj``), the
            Hessian of its inputs: those layers are quantized with GPTQ,
            the others (and all without it) rounded to nearest.
        awq_stats: By layer name, ``(X^T X / n, mean |x|)`` of its inputs:
            AWQ's scales are searched and folded first (``quant/awq.py``).

    Returns: ``{"layers": n, "gptq_layers": m, "bytes": size of the weights written}``.
    """
    from safetensors.torch import save_file

    from workers.model.quant import awq, gptq

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    if awq_stats is not None:  # every tensor at hand: scales move between layers
        tensors = dict(weights)
        heads = config["num_attention_heads"]
        awq.apply(tensors, awq_stats, config["num_hidden_layers"], group_size,
                  grouped_query=config.get("num_key_value_heads", heads) != heads)
        weights = iter(tensors.items())
    out: dict[str, torch.Tensor] = {}
    layers = with_gptq = 0
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part == "weight" and prefix.rsplit(".", 1)[-1] in LINEAR_SUFFIXES and ".layers." in f".{prefix}":
            h = (hessians or {}).get(prefix)
            w = tensor.float().numpy()
            decoded = gptq.gptq(w, h, group_size) if h is not None else gptq.rtn(w, group_size)
            for key, value in pack_layer(decoded, method).items():
                out[f"{prefix}.{key}"] = value.contiguous()
            layers += 1
            with_gptq += h is not None
            if layers % 20 == 0:
                logger.info("quantized %d layers (%d with GPTQ)", layers, with_gptq)
        else:
            out[name] = tensor.contiguous()
    save_file(out, str(dst / "model.safetensors"))
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": False,
         "checkpoint_format": "gptq"} if method == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    _copy_extras(src, dst)
    size = (dst / "model.safetensors").stat().st_size
    logger.info("wrote %s: %d layers as %s (group %d), %.1f MiB", dst, layers, method, group_size, size / 2**20)
    return {"layers": layers, "gptq_layers": with_gptq, "bytes": size}
