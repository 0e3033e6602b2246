"""A PEFT LoRA adapter read from its folder and checked against the model.

PEFT's format: ``adapter_config.json`` (``r``, ``lora_alpha``,
``use_rslora``, ``target_modules``, ...) and ``adapter_model.safetensors``
with ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and
``lora_B.weight`` ``[out, r]`` per target. A target adds
``x @ A.T @ B.T * scaling`` to its layer's output (``scaling`` is
``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``).

Our layers are fused (``qkv_proj`` holds q, k and v; ``gate_up_proj`` gate
and up), so an adapter's parts of one fused layer become one side path:
their A matrices stacked ``[sum r, in]`` and their B matrices placed
block-diagonally in ``[out, sum r]`` at the rows of their part, the scaling
applied to the side path's output as PEFT applies it. A fused target
(Phi-3's ``qkv_proj``) takes the whole layer.

Weights keep the format they were saved in when it is bfloat16 or float16
(every tensor of a layer alike): the kernels widen them to float32 exactly,
as PEFT's float32 forward does, so a 16-bit adapter costs half the memory
and half the bytes a step reads. Anything else is read as float32.

The adapter's identity for the prefix cache is :attr:`LoRAAdapter.content_hash`,
a hash of every tensor and the scaling, never its name.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from workers.model.linear import Linear
from workers.model.weights import fused_name

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
# Layers an adapter may target: the attention and dense MLP projections (not an MoE's experts or router).
TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# PEFT options that change the arithmetic and that we do not apply: refused rather than ignored.
_REFUSED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None,
            "rank_pattern": {}, "alpha_pattern": {}}


_HALF = (torch.bfloat16, torch.float16)  # formats kept as saved


@dataclass
class LayerDelta:
    """One layer's side path: ``(x @ a.T @ b.T) * scale``."""

    a: torch.Tensor  # [R, in]; float32, or bfloat16 / float16 as saved (b alike)
    b: torch.Tensor  # [out, R]
    scale: float = 1.0


@dataclass
class LoRAAdapter:
    """A loaded adapter: its deltas by our module name."""

    name: str
    path: str
    rank: int
    scaling: float
    content_hash: str
    deltas: dict[str, LayerDelta] = field(default_factory=dict)
    # The deltas packed for each layer's kernels (workers/lora/layers.py ``prepare``), when read ahead.
    prepared: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(self.delta_bytes(d) for d in self.deltas.values())

    @staticmethod
    def delta_bytes(delta: LayerDelta) -> int:
        return delta.a.numel() * delta.a.element_size() + delta.b.numel() * delta.b.element_size()


def load_adapter(name: str, path: str, model: nn.Module, max_lora_rank: int) -> LoRAAdapter:
    """Reads and checks the PEFT adapter in ``path`` against ``model``.

    Raises:
        ValueError: The folder or a file is missing or unreadable, the config
            uses an option we do not apply, the rank exceeds
            ``max_lora_rank``, a target is not a linear layer of the model (or
            one of an MoE's experts), or a tensor's shape does not fit its
            layer. Nothing is kept from a refused adapter.
    """
    folder = Path(path)
    where = f"LoRA adapter {name!r} ({path})"
    if not folder.is_dir():
        raise ValueError(f"{where}: no such folder; give a PEFT adapter folder ({CONFIG_FILE} + {WEIGHTS_FILE})")
    config = _read_config(folder / CONFIG_FILE, where)
    tensors = _read_tensors(folder / WEIGHTS_FILE, where)
    rank = config.get("r")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(f"{where}: {CONFIG_FILE} needs an integer r >= 1 and a numeric lora_alpha")
    if rank > max_lora_rank:
        raise ValueError(f"{where}: rank {rank} is above max_lora_rank {max_lora_rank}; "
                         f"start the engine with --max-lora-rank {rank} or more")
    if config.get("target_parameters"):  # PEFT >= 0.17 targets an MoE's fused experts by parameter
        raise ValueError(f"{where}: {CONFIG_FILE} sets target_parameters={config['target_parameters']!r}: "
                         "adapters on MoE experts are not supported; target the attention projections or a "
                         "dense MLP's gate/up/down")
    for key, neutral in _REFUSED.items():
        if config.get(key, neutral) not in (neutral, None, [], {}, False):
            raise ValueError(f"{where}: {CONFIG_FILE} sets {key}={config[key]!r}, which is not supported; "
                             "use a plain LoRA adapter")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    parts = _group_parts(tensors, rank, where)
    modules = dict(model.named_modules())
    deltas = {ours: _fuse(ours, pieces, modules, scaling, where) for ours, pieces in sorted(parts.items())}
    if not deltas:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no lora_A / lora_B weights")
    digest = hashlib.sha256(f"scaling={scaling!r}".encode())
    for key in sorted(tensors):
        t = tensors[key].to(torch.float32).contiguous()
        digest.update(f"{key}:{tuple(t.shape)}".encode())
        digest.update(t.numpy().tobytes())
    return LoRAAdapter(name, path, rank, scaling, digest.hexdigest()[:32], deltas)


def _read_config(path: Path, where: str) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{where}: no {CONFIG_FILE} in the folder") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: {CONFIG_FILE} is not readable JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    return config


def _read_tensors(path: Path, where: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        other = " (adapter_model.bin is not read: save with safe_serialization)" if (
            path.parent / "adapter_model.bin").exists() else ""
        raise ValueError(f"{where}: no {WEIGHTS_FILE} in the folder{other}")
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for a truncated or corrupt file
        raise ValueError(f"{where}: {WEIGHTS_FILE} is corrupt or unreadable: {exc}") from None


def _group_parts(tensors: dict[str, torch.Tensor], rank: int, where: str
                 ) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """``{our module: {shard id ('' = whole): {"A": .., "B": ..}}}``."""
    parts: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        stem = key.removeprefix(PREFIX)
        for which in ("A", "B"):
            suffix = f".lora_{which}.weight"
            if stem.endswith(suffix):
                break
        else:
            raise ValueError(f"{where}: tensor {key!r} is not a lora_A / lora_B weight: base weights saved "
                             "with the adapter (modules_to_save, an embedding or LM head) are not supported")
        module = stem[: -len(suffix)]
        ours, shard = fused_name(module + ".")
        ours = ours.rstrip(".")
        if ".experts." in ours or ".shared_expert" in ours or ours.rsplit(".", 1)[-1] not in TARGETS:
            raise ValueError(f"{where}: target {module!r} is not supported; adapters may target the attention "
                             "projections (q/k/v/o, qkv_proj) and a dense MLP's gate/up/down (not MoE experts, "
                             "the embeddings or the LM head)")
        kept = tensor if tensor.dtype in _HALF else tensor.to(torch.float32)
        parts.setdefault(ours, {}).setdefault(shard, {})[which] = kept
    for ours, shards in parts.items():
        for shard, pair in shards.items():
            if set(pair) != {"A", "B"}:
                raise ValueError(f"{where}: {ours} {shard or ''} has lora_{'A' if 'B' in pair else 'B'} missing")
            if pair["A"].dim() != 2 or pair["B"].dim() != 2 or pair["A"].shape[0] != rank or pair["B"].shape[1] != rank:
                raise ValueError(f"{where}: {ours} {shard}: lora_A {tuple(pair['A'].shape)} and lora_B "
                                 f"{tuple(pair['B'].shape)} do not have the config's rank {rank}")
    return parts


def _fuse(ours: str, pieces: dict[str, dict[str, torch.Tensor]], modules: dict[str, nn.Module], scaling: float,
          where: str) -> LayerDelta:
    layer = modules.get(ours)
    if not isinstance(layer, Linear):
        raise ValueError(f"{where}: the model has no linear layer {ours!r} (is the adapter for another model?)")
    parent = modules[ours.rsplit(".", 1)[0]]
    formats = {t.dtype for pair in pieces.values() for t in pair.values()}
    dtype = formats.pop() if len(formats) == 1 else torch.float32  # mixed formats: all widened
    a_rows, b = [], torch.zeros(layer.out_features, sum(p["A"].shape[0] for p in pieces.values()), dtype=dtype)
    col = 0
    for shard, pair in sorted(pieces.items()):
        start, size = (0, layer.out_features) if not shard else (
            parent.qkv_shard_rows(shard) if shard in ("q", "k", "v") else parent.gate_up_shard_rows(shard))
        a, b_part = pair["A"], pair["B"]
        if a.shape[1] != layer.in_features or b_part.shape[0] != size:
            raise ValueError(f"{where}: {ours} {shard}: lora_A {tuple(a.shape)} / lora_B {tuple(b_part.shape)} do "
                             f"not fit the layer ({layer.in_features} inputs, {size} outputs)")
        a_rows.append(a.to(dtype))
        b[start : start + size, col : col + a.shape[0]] = b_part  # widened exactly if the formats were mixed
        col += a.shape[0]
    return LayerDelta(torch.cat(a_rows).contiguous(), b.contiguous(), scaling)
