"""Loading HF-named checkpoint tensors into a model with fused projections.

HF checkpoints store ``q_proj`` / ``k_proj`` / ``v_proj`` and ``gate_proj`` /
``up_proj`` apart; our models fuse them (``qkv_proj``, ``gate_up_proj``: one
matmul instead of three, or two). Each tensor is copied into its rows of the
fused parameter; with tensor parallelism the rank's slice of the full tensor
first (``tp.shard_checkpoint_tensor``). Checkpoints that store them fused
(Phi-3) are split into the same parts first. Every parameter must get a tensor of
its shape, else the error names what does not match.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from workers.model.tp import shard_checkpoint_tensor

# HF projection name -> (our fused projection, shard id).
STACKED_PARAMS = (
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", "gate"),
    (".up_proj.", ".gate_up_proj.", "up"),
)
# Mixtral's MoE names -> the Qwen / Llama names our modules use.
RENAMES = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))
# Weights some checkpoints carry that have no parameter here.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def fused_name(hf_name: str) -> tuple[str, str]:
    """Maps an HF parameter name to ``(our parameter name, shard id or '')``."""
    if ".block_sparse_moe." in hf_name:
        for old, new in RENAMES:
            hf_name = hf_name.replace(old, new)
    for hf_part, fused_part, shard_id in STACKED_PARAMS:
        if hf_part in hf_name:
            return hf_name.replace(hf_part, fused_part), shard_id
    return hf_name, ""


def _split_fused(arch: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoints that store the projections fused already (Phi-3's ``qkv_proj``
    and ``gate_up_proj``) as their HF parts, so each is copied (and sharded) as
    the separate checkpoints' are."""
    for name, tensor in weights:
        if ".self_attn.qkv_proj." in name:
            q, k, v = torch.split(tensor, [arch.q_size, arch.kv_size, arch.kv_size], dim=0)
            yield from ((name.replace(".qkv_proj.", f".{p}_proj."), t) for p, t in (("q", q), ("k", k), ("v", v)))
        elif ".mlp.gate_up_proj." in name:
            gate, up = torch.chunk(tensor, 2, dim=0)
            yield name.replace(".gate_up_proj.", ".gate_proj."), gate
            yield name.replace(".gate_up_proj.", ".up_proj."), up
        else:
            yield name, tensor


def load_checkpoint(model: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copies HF-named ``weights`` into ``model``'s parameters (mutates them).

    Raises:
        ValueError: A tensor matches no parameter or has the wrong shape, or a
            parameter gets no tensor.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[tuple[str, str]] = set()
    tied = model.arch.tie_word_embeddings
    for name, tensor in _split_fused(model.arch, weights):
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and tied:
            continue  # some tied checkpoints store the copy too
        target, shard_id = fused_name(name)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of {model.arch.family} model")
        if model.tp is not None:
            tensor = shard_checkpoint_tensor(model.shard, model.arch.head_dim, target, shard_id, tensor)
        if model.arch.sandwich_norms and target.endswith("norm.weight"):
            tensor = tensor.float() + 1.0  # Gemma's norms multiply by (1 + w): folded in once
        _copy_into(model, params[target], target, shard_id, tensor)
        loaded.add((target, shard_id))
    _check_all_loaded(model, loaded)


def _copy_into(model: Any, param: torch.Tensor, target: str, shard_id: str, tensor: torch.Tensor) -> None:
    dest = param.data
    if shard_id:
        module = model.get_submodule(target.rsplit(".", 2)[0])
        shard_rows = module.qkv_shard_rows if shard_id in ("q", "k", "v") else module.gate_up_shard_rows
        start, size = shard_rows(shard_id)
        dest = dest.narrow(0, start, size)
    if dest.shape != tensor.shape:
        label = f"{target} [{shard_id}]" if shard_id else target
        raise ValueError(
            f"checkpoint tensor for {label} has shape {tuple(tensor.shape)}, the config expects "
            f"{tuple(dest.shape)}; check that config.json belongs to these weights"
        )
    dest.copy_(tensor)


def _check_all_loaded(model: Any, loaded: set[tuple[str, str]]) -> None:
    expected: set[tuple[str, str]] = set()
    for name, _ in model.named_parameters():
        if name == "lm_head.weight" and model.arch.tie_word_embeddings:
            continue
        if ".qkv_proj." in name:
            expected.update((name, s) for s in ("q", "k", "v"))
        elif ".gate_up_proj." in name:
            expected.update((name, s) for s in ("gate", "up"))
        else:
            expected.add((name, ""))
    missing = sorted(f"{n}[{s}]" if s else n for n, s in expected - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint lacks {len(missing)} weights: {shown}")
