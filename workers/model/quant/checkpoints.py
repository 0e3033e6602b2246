"""GPTQ and AWQ checkpoints: their standard 4-bit layouts, read and written.

A folder whose ``config.json`` has ``quantization_config.quant_method`` ``gptq``
or ``awq`` is loaded with its packed tensors (vLLM does the same without being
told; ``quantization=`` may name the method or stay None)::

    GPTQ (v1, AutoGPTQ / GPTQModel)          AWQ (AutoAWQ "GEMM")
    qweight int32 [K / 8, N]  along K        qweight int32 [K, N / 8]  along N, nibble i
            nibble j = input 8i + j                  = column 8c + (0,2,4,6,1,3,5,7)[i]
    qzeros  int32 [G, N / 8]  zero - 1       qzeros  int32 [G, N / 8]  same order, zero
    scales  fp16  [G, N]                     scales  fp16  [G, N]
    g_idx   int32 [K]  group of each input   (groups of group_size consecutive inputs)
            (act order: not consecutive)

    W[n, k] = scales[g(k), n] * (q[k, n] - zero[g(k), n])

Each layer becomes a ``qgemm.QuantWeight`` (4-bit, ``scale * q + min`` with
``min = -scale * zero``); the float model is loaded with exactly those values
(``scale * q + min`` in float32), so the quantized and the float runs compute
the same weights. With act order the inputs are permuted so that groups are
consecutive and ``x`` is permuted the same way at run time (one permutation
per input: GPTQ derives it from the inputs' Hessian, which q/k/v and
gate/up share). ``write_checkpoint`` writes both layouts from a float model
(``prefixserve quantize``).

W8A8 (SmoothQuant) checkpoints use compressed-tensors' ``int-quantized``
format, as llm-compressor writes and vLLM reads: each linear layer's
``weight`` int8 ``[N, K]`` and ``weight_scale`` ``[N, 1]`` (symmetric, one
scale per output channel), activations quantized per token at run time
(``input_activations.dynamic``), the smoothing already folded into the float
norms and producer rows; ``write_w8a8_checkpoint`` writes one.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from workers.model.quant.gguf_blocks import DecodedWeight

logger = logging.getLogger(__name__)

METHODS = ("gptq", "awq")
W8A8 = "w8a8"  # compressed-tensors int-quantized
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column offset held by nibble i of a packed AWQ int32
PARTS = ("qweight", "qzeros", "scales")
LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class QuantSpec:
    """``quantization_config`` of a GPTQ / AWQ checkpoint."""

    method: str
    bits: int
    group_size: int
    desc_act: bool = False

    @classmethod
    def from_config(cls, folder: Path) -> Optional["QuantSpec"]:
        """The folder's spec, None when its config.json has no GPTQ / AWQ ``quantization_config``.

        Raises:
            ValueError: A method or setting this loader does not read (says which).
        """
        path = folder / "config.json"
        if not path.is_file():
            return None
        qc = json.loads(path.read_text()).get("quantization_config")
        if not qc:
            return None
        method = str(qc.get("quant_method", "")).lower()
        if method == "compressed-tensors":
            return cls._compressed_tensors(path, qc)
        if method not in METHODS:
            raise ValueError(f"{path}: quantization_config.quant_method {method!r} is not supported; "
                             f"supported: gptq, awq, compressed-tensors (W8A8 int8)")
        bits = int(qc.get("bits", qc.get("w_bit", 4)))
        group = int(qc.get("group_size", qc.get("q_group_size", 128)))
        if bits != 4:
            raise ValueError(f"{path}: {method} with bits={bits}: only 4-bit checkpoints are supported")
        if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"{path}: AWQ version {qc.get('version')!r}: only the GEMM layout is supported")
        if method == "gptq" and str(qc.get("checkpoint_format", "gptq")).lower() != "gptq":
            raise ValueError(f"{path}: GPTQ checkpoint_format {qc.get('checkpoint_format')!r}: only 'gptq' (v1)")
        return cls(method, bits, group, bool(qc.get("desc_act", False)))

    @classmethod
    def _compressed_tensors(cls, path: Path, qc: dict) -> "QuantSpec":
        """compressed-tensors: only W8A8 int8 (weights per channel, activations per token, dynamic)."""
        groups = list((qc.get("config_groups") or {}).values())
        supported = ("compressed-tensors is read for W8A8 int8 only (format int-quantized; weights int 8-bit "
                     "symmetric per channel; input activations int 8-bit symmetric per token, dynamic)")
        if str(qc.get("format", "")) != "int-quantized" or len(groups) != 1:
            raise ValueError(f"{path}: compressed-tensors format {qc.get('format')!r} with {len(groups)} config "
                             f"groups: {supported}")
        w, a = groups[0].get("weights") or {}, groups[0].get("input_activations") or {}
        if (w.get("num_bits"), w.get("type"), w.get("symmetric"), w.get("strategy")) != (8, "int", True, "channel") \
                or (a.get("num_bits"), a.get("type"), a.get("symmetric"), a.get("strategy"), a.get("dynamic")) \
                != (8, "int", True, "token", True):
            raise ValueError(f"{path}: compressed-tensors weights {w} and input_activations {a}: {supported}")
        return cls(W8A8, 8, 0)


@dataclass
class LoadedQuant:
    """One layer of the checkpoint: its 4-bit weight, and the input permutation of act order."""

    decoded: DecodedWeight
    perm: Optional[np.ndarray] = None  # inputs in group order; None when groups are consecutive


# ----------------------------------------------------------------- unpacking
def _nibbles(packed: np.ndarray, axis: int) -> np.ndarray:
    """int32 -> the eight 4-bit values of each, along ``axis`` (nibble j at position 8i + j)."""
    u = packed.astype(np.uint32)
    parts = [(u >> np.uint32(4 * j)) & np.uint32(15) for j in range(8)]
    stacked = np.stack(parts, axis=axis + 1)  # [..., n, 8, ...]
    shape = list(packed.shape)
    shape[axis] *= 8
    return stacked.reshape(shape).astype(np.uint8)


def _awq_columns(packed: np.ndarray) -> np.ndarray:
    """AWQ's [R, N / 8] int32 -> [R, N] values in column order."""
    nib = _nibbles(packed, 1).reshape(packed.shape[0], -1, 8)  # [R, N/8, nibble]
    out = np.empty_like(nib)
    out[:, :, list(AWQ_ORDER)] = nib
    return out.reshape(packed.shape[0], -1)


def decode_layer(name: str, tensors: dict[str, torch.Tensor], spec: QuantSpec) -> LoadedQuant:
    """One layer's packed tensors -> 4-bit values, scales and mins per group (rows = outputs).

    Raises:
        ValueError: A missing tensor or a shape that does not fit the spec (names the tensor).
    """
    for part in PARTS:
        if part not in tensors:
            raise ValueError(f"{name}: {spec.method} checkpoint lacks {name}.{part} (expected "
                             f"{', '.join(name + '.' + p for p in PARTS)})")
    qweight = tensors["qweight"].numpy()
    qzeros = tensors["qzeros"].numpy()
    scales = tensors["scales"].float().numpy()
    if spec.method == "gptq":
        q = _nibbles(qweight, 0)  # [K, N]
        zeros = (_nibbles(qzeros, 1).astype(np.int32) + 1) & 15  # v1 stores zero - 1 (0 - 1 wraps to 15)
    else:
        q = _awq_columns(qweight)  # [K, N]
        zeros = _awq_columns(qzeros).astype(np.int32)
    k, n = q.shape
    groups = -(-k // spec.group_size)
    if scales.shape != (groups, n) or zeros.shape != (groups, n):
        raise ValueError(f"{name}.scales has shape {tuple(scales.shape)} and {name}.qzeros holds "
                         f"{tuple(zeros.shape)} zeros; group_size {spec.group_size} over {k} inputs and {n} "
                         f"outputs expects ({groups}, {n}): check quantization_config.group_size")
    g_idx = tensors.get("g_idx")
    perm = None
    if g_idx is not None:
        g = g_idx.numpy().astype(np.int64)
        if g.shape != (k,) or g.min() < 0 or g.max() >= groups:
            raise ValueError(f"{name}.g_idx must hold {k} group numbers in [0, {groups}), got shape "
                             f"{tuple(g.shape)}")
        if np.any(np.bincount(g, minlength=groups) > spec.group_size):
            raise ValueError(f"{name}.g_idx puts more than group_size {spec.group_size} inputs in a group")
        if not np.array_equal(g, np.arange(k) // spec.group_size):
            perm = np.argsort(g, kind="stable")  # act order: groups made consecutive
            q = q[perm]
            if np.any(np.bincount(g, minlength=groups)[:-1] != spec.group_size):
                raise ValueError(f"{name}.g_idx: every group but the last must hold {spec.group_size} inputs")
    scale_t = scales.T.astype(np.float32)  # [N, G]
    mins = (-scale_t * zeros.T.astype(np.float32)).astype(np.float32)
    decoded = DecodedWeight(np.ascontiguousarray(q.T), np.ascontiguousarray(scale_t), np.ascontiguousarray(mins),
                            4, spec.group_size, f"{spec.method}-g{spec.group_size}")
    return LoadedQuant(decoded, perm)


def float_weight(layer: LoadedQuant) -> torch.Tensor:
    """The float32 weight ``[N, K]`` the layer computes with (inputs in checkpoint order)."""
    w = layer.decoded.dequantize()
    if layer.perm is not None:
        out = np.empty_like(w)
        out[:, layer.perm] = w
        w = out
    return torch.from_numpy(w)


def read_checkpoint(weights: Iterator[tuple[str, torch.Tensor]], spec: QuantSpec,
                    quantized: dict[str, LoadedQuant]) -> Iterator[tuple[str, torch.Tensor]]:
    """Passes float tensors through, decodes each quantized layer into ``quantized``
    (HF prefix -> layer) and yields its float weight as ``<prefix>.weight``."""
    if spec.method == W8A8:
        yield from _read_w8a8(weights, quantized)
        return
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part in (*PARTS, "g_idx"):  # decoded once every file is read (a layer's parts may be split)
            pending.setdefault(prefix, {})[part] = tensor
            continue
        yield name, tensor
    for prefix, layer in pending.items():
        loaded = decode_layer(prefix, layer, spec)
        quantized[prefix] = loaded
        yield prefix + ".weight", float_weight(loaded)


def _read_w8a8(weights: Iterator[tuple[str, torch.Tensor]],
               quantized: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """compressed-tensors W8A8: each int8 ``weight`` with its ``weight_scale`` into ``quantized``
    (prefix -> ``(q [N, K] int8, scales [N] float32)``), yielded as ``scale * q`` in float32."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part == "weight_scale" or (part == "weight" and tensor.dtype == torch.int8):
            pending.setdefault(prefix, {})[part] = tensor
            continue
        yield name, tensor
    for prefix, parts in pending.items():
        if set(parts) != {"weight", "weight_scale"}:
            have = ", ".join(f"{prefix}.{p}" for p in sorted(parts))
            raise ValueError(f"{prefix}: a W8A8 layer needs an int8 {prefix}.weight and its {prefix}.weight_scale, "
                             f"found only {have}")
        q, scale = parts["weight"], parts["weight_scale"].float().reshape(-1)
        if scale.shape[0] != q.shape[0]:
            raise ValueError(f"{prefix}.weight_scale holds {scale.shape[0]} scales for {q.shape[0]} output channels "
                             "(one per channel expected)")
        quantized[prefix] = (q.numpy(), scale.numpy().astype(np.float32))
        yield prefix + ".weight", q.float() * scale[:, None]


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
