"""What one engine (or one tensor-parallel rank) gets for its config: the
device, the model with its dtype and attention backend, ``max_model_len``,
and how many device and swap KV blocks fit. Shared by ``builder.py`` (one
process) and ``parallel.py`` (rank actors).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from cluster.shared.config import EngineConfig
from cluster.shared.sizes import GiB, cdiv
from workers.model.attention import get_attention_backend
from workers.model.config import ModelArchConfig
from workers.model.llama import LlamaForCausalLM
from workers.model.loader import load_model, resolve_dtype
from workers.model.tp import TPContext


def pick_device(config: EngineConfig) -> torch.device:
    if config.device:
        return torch.device(config.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def num_kv_blocks_for(config: EngineConfig, block_bytes: int, device: torch.device, max_model_len: int) -> int:
    """Device KV blocks: explicit ``num_kv_blocks``, else memory-derived.

    The memory-derived count is capped at what ``max_num_seqs`` sequences of
    ``max_model_len`` tokens can use: small models would otherwise get
    millions of blocks that cost start-up time and nothing else.
    """
    if config.cache.num_kv_blocks is not None:
        return config.cache.num_kv_blocks
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = total * config.cache.gpu_memory_utilization - used
        # Leave room for activations of one max-size step.
        budget -= 512 * 1024 * 1024
    else:
        budget = config.cache.kv_cache_memory * GiB
    block_size = config.cache.block_size
    useful = config.scheduler.max_num_seqs * cdiv(max_model_len, block_size)
    return max(1, min(useful, int(budget // block_bytes)))


def num_cpu_blocks_for(config: EngineConfig, block_bytes: int, num_kv_blocks: int) -> int:
    """CPU swap blocks: ``swap_space`` GiB, at most twice the device blocks; 0 without swap."""
    if config.scheduler.preemption_mode != "swap":
        return 0
    return min(int(config.cache.swap_space * GiB // block_bytes), 2 * num_kv_blocks)


def resolve_max_model_len(config: EngineConfig, arch: ModelArchConfig) -> int:
    """``max_model_len``, defaulting to the model's ``max_position_embeddings``.

    Raises:
        ValueError: If it exceeds the model's positions.
    """
    max_model_len = config.max_model_len or arch.max_position_embeddings
    if max_model_len > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
            f"{arch.max_position_embeddings}: lower max_model_len"
        )
    return max_model_len


def gguf_source(config: EngineConfig) -> Optional[Path]:
    """The .gguf file the model comes from (the default model's when ``model`` is None), else None."""
    if config.model is None:
        from workers.model.loader import default_gguf_path

        return default_gguf_path()
    path = Path(config.model)
    return path if path.suffix == ".gguf" and path.is_file() else None


def load_model_for(
    config: EngineConfig, model_dir: Path, device: torch.device, tp: Optional[TPContext] = None
) -> tuple[LlamaForCausalLM, ModelArchConfig, torch.dtype]:
    """Loads the model (or, with ``tp``, one rank's shard) with the configured
    dtype and attention backend."""
    # float32 on CPU: bf16 matmuls are 5-60x slower without AVX-512.
    dtype = resolve_dtype(config.dtype, device)
    if config.batch_invariant and config.linear_backend not in ("auto", "native"):
        raise ValueError(f"batch_invariant needs linear_backend native (or auto), got {config.linear_backend!r}")
    backend = get_attention_backend(config.attention_backend, device, dtype=dtype, block_size=config.cache.block_size,
                                    batch_invariant=config.batch_invariant)
    if config.cache.kv_cache_dtype == "int8" and (device.type != "cpu" or backend.name != "torch"):
        raise ValueError(f"kv_cache_dtype='int8' runs on CPU with the torch attention backend; got the "
                         f"{backend.name!r} backend on {device.type}: use kv_cache_dtype='auto' there")
    spec = config.speculative
    if spec is not None and spec.num_candidates > 1 and backend.name != "torch":
        raise ValueError(f"speculative_config num_candidates > 1 (tree verification) needs the torch attention "
                         f"backend; attention_backend {config.attention_backend!r} is {backend.name!r} on "
                         f"{device.type} here: set num_candidates 1 or attention_backend 'torch'")
    model, arch = load_model(model_dir, dtype=dtype, device=device, attn_backend=backend, tp=tp,
                             linear_backend="native" if config.batch_invariant else config.linear_backend,
                             enforce_eager=config.enforce_eager, quantization=config.quantization,
                             quantization_group_size=config.quantization_group_size, gguf_path=gguf_source(config))
    return model, arch, dtype
