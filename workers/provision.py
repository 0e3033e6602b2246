"""What one engine (or one tensor-parallel rank) gets for its config: the
device, the model with its dtype and attention backend, ``max_model_len``,
and how many device and swap KV blocks fit. Shared by ``builder.py`` (one
process) and ``parallel.py`` (rank actors).
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Optional

import torch

from cluster.shared.config import EngineConfig
from cluster.shared.sizes import GiB, cdiv
from workers.model.attention import get_attention_backend
from workers.model.config import ModelArchConfig
from workers.model.llama import LlamaForCausalLM
from workers.model.loader import load_model, read_arch, resolve_dtype
from workers.model.tp import TPContext

logger = logging.getLogger(__name__)


def pick_device(config: EngineConfig) -> torch.device:
    if config.device:
        return torch.device(config.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def num_kv_blocks_for(config: EngineConfig, block_bytes: int, device: torch.device, max_model_len: int,
                      activation_bytes: int = 0) -> int:
    """Device KV blocks: explicit ``num_kv_blocks``, else memory-derived.

    On a GPU: ``gpu_memory_utilization`` of the device's memory, less what is
    in use now (weights, CUDA context, other processes) and the peak a step
    takes on top (``activation_bytes``, from ``profile_step_bytes``), like
    vLLM's profiling run. On CPU: ``kv_cache_memory`` GiB.

    The memory-derived count is capped at what ``max_num_seqs`` sequences of
    ``max_model_len`` tokens can use: small models would otherwise get
    millions of blocks that cost start-up time and nothing else.

    Raises:
        ValueError: No room is left for a single block (says what to change).
    """
    if config.cache.num_kv_blocks is not None:
        return config.cache.num_kv_blocks
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = kv_budget_bytes(total, total - free, config.cache.gpu_memory_utilization, activation_bytes)
    else:
        budget = config.cache.kv_cache_memory * GiB
    if budget < block_bytes:
        raise ValueError(
            f"no memory left for the KV cache on {device}: budget {budget / GiB:.2f} GiB, a block takes "
            f"{block_bytes / GiB:.4f} GiB (activations of a step {activation_bytes / GiB:.2f} GiB): raise "
            "gpu_memory_utilization (kv_cache_memory on CPU), or lower max_num_batched_tokens / max_num_seqs")
    block_size = config.cache.block_size
    useful = config.scheduler.max_num_seqs * cdiv(max_model_len, block_size)
    return max(1, min(useful, int(budget // block_bytes)))


def kv_budget_bytes(total: int, in_use: int, utilization: float, activation_bytes: int) -> int:
    """Bytes the KV cache may take on a GPU of ``total`` bytes: ``utilization``
    of it, less what is ``in_use`` (weights, context, other processes) and
    the peak a step adds (``activation_bytes``)."""
    return int(total * utilization) - in_use - activation_bytes


def profile_batch(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[tuple[int, int]]:
    """``(context, query tokens)`` per sequence of the profiling step: the most
    memory one step can take. A full token budget, its first chunk at the end
    of a ``max_model_len`` sequence (backends that materialize attention scores
    grow with query x context), the rest spread over up to ``max_num_seqs``
    sequences; every sequence samples."""
    first = min(max_num_batched_tokens, max_model_len)
    batch = [(max_model_len - first, first)]
    left = max_num_batched_tokens - first
    while left > 0 and len(batch) < max_num_seqs:
        n = min(left, max_model_len)
        batch.append((0, n))
        left -= n
    return batch


def cuda_graph_sizes_for(config: EngineConfig, device: torch.device, model: LlamaForCausalLM,
                         tensor_parallel: bool = False) -> Optional[list[int]]:
    """Decode batch sizes to capture as CUDA graphs (``enforce_eager`` False on
    a GPU, ``workers/cuda_graphs.py``), or None to run eagerly (logged why)."""
    from workers.cuda_graphs import graph_batch_sizes

    if config.enforce_eager or device.type != "cuda":
        return None
    backend = model.model.layers[0].self_attn.attn_backend.name
    if tensor_parallel or backend != "triton":
        why = "tensor parallelism" if tensor_parallel else f"the {backend!r} attention backend"
        logger.info("enforce_eager False: CUDA graphs need the triton attention backend and no tensor "
                    "parallelism; running eagerly with %s", why)
        return None
    return graph_batch_sizes(config.scheduler.max_num_seqs)


def activation_bytes_for(model: LlamaForCausalLM, config: EngineConfig, num_kv_heads: int, head_dim: int,
                         dtype: torch.dtype, device: torch.device, max_model_len: int) -> int:
    """What ``num_kv_blocks_for`` keeps free for a step: profiled on a GPU
    whose KV cache is sized from memory, else 0 (CPU: ``kv_cache_memory`` is
    the KV cache's own budget)."""
    if device.type != "cuda" or config.cache.num_kv_blocks is not None:
        return 0
    return profile_step_bytes(model, config, num_kv_heads, head_dim, dtype, device, max_model_len)


def profile_step_bytes(model: LlamaForCausalLM, config: EngineConfig, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device, max_model_len: int, memory: Optional[object] = None
                       ) -> int:
    """Peak bytes a step adds to the weights: one forward over ``profile_batch``
    (dummy tokens, a KV cache just big enough, allocated before the
    measurement) and its logits. On a tensor-parallel rank every rank must
    call it (the forward has collectives). ``memory``: the CUDA memory API
    (injectable for tests)."""
    from workers.model.attention.base import AttentionMetadata
    from workers.kv_memory import kv_layout

    mem = memory if memory is not None else torch.cuda
    bs = config.cache.block_size
    batch = profile_batch(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs, max_model_len)
    num_blocks = sum(cdiv(c + q, bs) for c, q in batch)
    cache_dtype, row = kv_layout(head_dim, dtype, config.cache.kv_cache_dtype)
    caches = [torch.zeros(2, num_blocks, bs, num_kv_heads, row, dtype=cache_dtype, device=device)
              for _ in range(model.arch.num_hidden_layers)]
    slots, positions, query_lens, seq_lens, tables = [], [], [], [], []
    first_block = 0
    for context, query in batch:
        n = cdiv(context + query, bs)
        table = list(range(first_block, first_block + n))
        first_block += n
        pos = range(context, context + query)
        positions.extend(pos)
        slots.extend(table[p // bs] * bs + p % bs for p in pos)
        query_lens.append(query)
        seq_lens.append(context + query)
        tables.append(table)
    meta = AttentionMetadata.build(slots, query_lens, seq_lens, tables, device)
    ids = torch.zeros(len(positions), dtype=torch.long, device=device)
    pos_t = torch.tensor(positions, dtype=torch.long, device=device)
    mem.synchronize(device)
    mem.reset_peak_memory_stats(device)
    before = mem.memory_allocated(device)
    with torch.inference_mode():
        hidden = model(ids, pos_t, caches, meta)
        rows = torch.tensor(list(itertools.accumulate(query_lens)), device=device) - 1
        logits = model.compute_logits(hidden.index_select(0, rows))
        if logits is not None:
            torch.softmax(logits, dim=-1)  # the sampler's probabilities
    mem.synchronize(device)
    peak = mem.max_memory_allocated(device) - before
    del caches, hidden, logits
    mem.empty_cache()
    logger.info("profiling step (%d tokens, %d sequences): %.3f GiB of activations", len(positions), len(batch),
                peak / GiB)
    return max(0, peak)


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
    """The .gguf file the model comes from (the default or a packaged model's included), else None."""
    from workers.model.loader import model_gguf_path

    return model_gguf_path(config.model)


def load_model_for(
    config: EngineConfig, model_dir: Path, device: torch.device, tp: Optional[TPContext] = None
) -> tuple[LlamaForCausalLM, ModelArchConfig, torch.dtype]:
    """Loads the model (or, with ``tp``, one rank's shard) with the configured
    dtype and attention backend."""
    # float32 on CPU: bf16 matmuls are 5-60x slower without AVX-512.
    dtype = resolve_dtype(config.dtype, device)
    if config.batch_invariant and config.linear_backend not in ("auto", "native"):
        raise ValueError(f"batch_invariant needs linear_backend native (or auto), got {config.linear_backend!r}")
    softcap = read_arch(model_dir).attn_logit_softcapping is not None
    backend = get_attention_backend(config.attention_backend, device, dtype=dtype, block_size=config.cache.block_size,
                                    batch_invariant=config.batch_invariant, attn_softcap=softcap)
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
