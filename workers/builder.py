"""Assembles one engine from an ``EngineConfig``: model, tokenizer, KV pools,
scheduler and runner. Shared by the offline ``LLM`` and the replica.
"""

from __future__ import annotations

import gc
import logging
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Union

from tokenizers import Tokenizer

from cluster.shared.config import EngineConfig, SpeculativeConfig
from cluster.shared.sizes import GiB, cdiv
from workers.engine.block_pool import BlockPool
from workers.engine.engine import LLMEngine
from workers.engine.kv_manager import KVCacheManager
from workers.engine.scheduler import Scheduler
from workers.engine.proposers import RunnerProposer
from workers.engine.spec_decode import Speculator
from workers.engine.structured import JumpForwardProposer
from workers.model.config import ModelArchConfig
from workers.model.longrope import LongRopeScaling
from workers.model.loader import model_fingerprint, read_arch, resolve_model
from workers.provision import (
    activation_bytes_for,
    cuda_graph_sizes_for,
    load_model_for,
    num_cpu_blocks_for,
    num_kv_blocks_for,
    pick_device,
    resolve_max_model_len,
)
from workers.runner import ModelRunner
from workers.kv_memory import kv_block_bytes
from workers.structured import make_backend

if TYPE_CHECKING:
    from workers.lora.manager import LoRAManager
    from workers.parallel import TensorParallelRunner

logger = logging.getLogger(__name__)

@dataclass
class EngineParts:
    """What ``build_engine`` made, for callers that need more than the engine."""

    engine: LLMEngine
    runner: Union[ModelRunner, "TensorParallelRunner"]  # both have execute() and shutdown()
    tokenizer: Optional[Tokenizer]
    model_dir: Path
    eos_token_ids: list[int]


def load_tokenizer(model_dir: Path, tokenizer: Optional[str] = None) -> Optional[Tokenizer]:
    """The model's (or the given) tokenizer.json; None when the model folder
    has none (token-id prompts only, no text output)."""
    path = Path(tokenizer) if tokenizer else model_dir
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        if tokenizer:
            raise ValueError(f"no tokenizer.json at {path}: pass tokenizer=<folder or tokenizer.json>")
        logger.warning("%s has no tokenizer.json: prompts must be token ids and outputs have no text", model_dir)
        return None
    return Tokenizer.from_file(str(path))


def build_local_runner(config: EngineConfig, model_dir: Path, max_model_len: int) -> ModelRunner:
    """The model and its KV cache in this process (``tensor_parallel_size`` 1)."""
    device = pick_device(config)
    model, arch, dtype = load_model_for(config, model_dir, device)
    block_bytes = kv_block_bytes(arch.num_hidden_layers, config.cache.block_size, arch.num_key_value_heads,
                                 arch.head_dim, dtype, config.cache.kv_cache_dtype)
    activations = activation_bytes_for(model, config, arch.num_key_value_heads, arch.head_dim, dtype, device,
                                       max_model_len)
    num_blocks = num_kv_blocks_for(config, block_bytes, device, max_model_len, activations)
    return ModelRunner(
        model,
        num_layers=arch.num_hidden_layers,
        num_kv_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        block_size=config.cache.block_size,
        num_kv_blocks=num_blocks,
        num_cpu_blocks=num_cpu_blocks_for(config, block_bytes, num_blocks),
        dtype=dtype,
        device=device,
        seed=config.seed,
        kv_cache_dtype=config.cache.kv_cache_dtype,
        cuda_graph_sizes=cuda_graph_sizes_for(config, device, model),
        max_blocks_per_seq=cdiv(max_model_len, config.cache.block_size),
        prefault_kv=config.cache.kv_cache_prefault,
    )


def attach_medusa_heads(runner: Union[ModelRunner, "TensorParallelRunner"], folder: Optional[str],
                        arch: ModelArchConfig) -> RunnerProposer:
    """Loads Medusa heads onto the runner, which then guesses each step's next
    tokens; returns the proposer that hands them to the scheduler."""
    from workers.model.medusa import MedusaHeads

    assert isinstance(runner, ModelRunner), "EngineConfig refuses medusa with tensor parallelism"
    heads = MedusaHeads.load(Path(folder or ""), arch.hidden_size, arch.vocab_size)
    runner.medusa = heads.to(device=runner.device, dtype=next(runner.model.parameters()).dtype)
    if heads.shortlist is not None:
        heads.shortlist = heads.shortlist.to(runner.device)
    heads.bind_lm_head(runner.model.lm_head)
    heads.bind_embedding(runner.model.model.embed_tokens)
    logger.info("Medusa heads from %s: %d heads of %d block(s)%s", folder, heads.num_heads, heads.num_layers,
                f", scored on a shortlist of {len(heads.shortlist)} tokens" if heads.shortlist is not None else "")
    return RunnerProposer()


def attach_lora(runner: Union[ModelRunner, "TensorParallelRunner"], config: EngineConfig) -> "LoRAManager":
    """Gives the model's layers LoRA side paths (every rank's, with tensor
    parallelism) and loads ``lora_modules``."""
    from workers.lora.manager import LoRAManager
    from workers.lora.side_paths import AdapterSlots

    if isinstance(runner, ModelRunner):
        native = any(getattr(m, "backend", "") == "native" for m in runner.model.modules())
        return LoRAManager(AdapterSlots(runner.model, config.lora.max_lora_rank, native), config.lora)
    return LoRAManager(runner.attach_lora(config.lora.max_lora_rank), config.lora)


def _tokenizer_file(model_dir: Path, tokenizer: Optional[str]) -> Optional[Path]:
    path = Path(tokenizer) if tokenizer else model_dir
    path = path / "tokenizer.json" if path.is_dir() else path
    return path if path.is_file() else None


def with_jump_forward(speculator: Optional[Speculator], grammar_of, limit: int) -> Speculator:
    """The speculator that proposes a constrained sequence's forced tokens
    first (``workers/engine/structured.py``), then the configured proposer's;
    without a speculative config, forced tokens only, as adaptive as any
    proposer (its acceptance and the step's measured cost size the drafts)."""
    if speculator is None:
        return Speculator(SpeculativeConfig(num_speculative_tokens=limit),
                          proposer=JumpForwardProposer(grammar_of, limit))
    return Speculator(speculator.config, proposer=JumpForwardProposer(grammar_of, limit, speculator.proposer))


def freeze_heap() -> None:
    """Takes every object alive now out of the cyclic garbage collector's
    reach (``gc.freeze()``, as vLLM and SGLang do after start-up).

    Loading builds hundreds of thousands of long-lived objects (modules,
    parameters, tokenizer tables); each full collection while serving would
    walk them all on the engine thread, a stall of milliseconds in the middle
    of a step. For processes that build one engine for their life (a
    replica, ``prefixserve generate`` / ``chat`` / ``bench``): frozen
    objects in reference cycles are never reclaimed, so a process that
    builds and drops many engines should not call it.
    """
    gc.collect()
    gc.freeze()


def build_engine(config: EngineConfig) -> EngineParts:
    """Loads the model and builds a ready engine (logs progress).

    With ``tensor_parallel_size`` N > 1 the model runs on N rank actors
    (``workers/parallel.py``; a local Ray is started when this process has
    none), inside the caller's placement group when it has one.
    """
    started = time.monotonic()
    model_dir = resolve_model(config.model)
    arch = read_arch(model_dir)
    max_model_len = resolve_max_model_len(config, arch)
    tp = config.parallel.tensor_parallel_size
    runner: Union[ModelRunner, TensorParallelRunner]
    if tp > 1:
        from workers.parallel import TensorParallelRunner

        runner = TensorParallelRunner.create(config, model_dir, max_model_len)
    else:
        runner = build_local_runner(config, model_dir, max_model_len)
    tokenizer = load_tokenizer(model_dir, config.tokenizer)
    block_size = config.cache.block_size
    num_blocks, num_cpu_blocks = runner.num_kv_blocks, runner.num_cpu_blocks
    kv_manager = KVCacheManager(
        BlockPool(num_blocks, block_size, enable_caching=config.cache.enable_prefix_caching),
        BlockPool(num_cpu_blocks, block_size, enable_caching=False) if num_cpu_blocks else None,
    )
    eos = list(arch.eos_token_ids)
    windows = {arch.layer_sliding_window(i) for i in range(arch.num_hidden_layers)}
    window = windows.pop() if len(windows) == 1 else None  # released only when every layer slides
    speculator = None
    if config.speculative is not None:
        proposer = None
        if config.speculative.method == "draft_model":
            from workers.spec_draft import build_draft_proposer

            proposer = build_draft_proposer(config, model_dir, arch.vocab_size, num_blocks)
        elif config.speculative.method == "medusa":
            proposer = attach_medusa_heads(runner, config.speculative.model, arch)
        elif config.speculative.method == "eagle":
            from workers.spec_eagle import attach_eagle

            proposer = attach_eagle(runner, config.speculative.model, arch)
        elif config.speculative.method == "eagle3":
            from workers.spec_eagle3 import attach_eagle3

            proposer = attach_eagle3(runner, config.speculative.model, arch)
        speculator = Speculator(config.speculative, proposer=proposer)
    structured = make_backend(_tokenizer_file(model_dir, config.tokenizer), arch.vocab_size, eos,
                              config.structured_outputs)
    # The jump-forward proposer reads the grammar states of the scheduler built below, through a weak
    # reference: a cycle (scheduler -> speculator -> proposer -> scheduler) would keep a dropped
    # engine's KV cache alive until the cyclic collector happens to run.
    scheduler_ref: list[Callable[[], Optional[Scheduler]]] = [lambda: None]

    def grammar_of(request_id: str):
        scheduler = scheduler_ref[0]()
        seq = scheduler.get_request(request_id) if scheduler is not None else None
        return seq.grammar if seq is not None else None

    if structured is not None and config.structured_outputs.jump_forward:
        speculator = with_jump_forward(speculator, grammar_of, config.structured_outputs.max_jump_forward_tokens)
    scheduler = Scheduler(config.scheduler, kv_manager, max_model_len=max_model_len, eos_token_ids=eos,
                          sliding_window=window, speculator=speculator, structured=structured)
    scheduler_ref[0] = weakref.ref(scheduler)
    scheduler.max_loras = config.lora.max_loras
    engine = LLMEngine(
        scheduler,
        runner,
        tokenizer,
        vocab_size=arch.vocab_size,
        max_model_len=max_model_len,
        model_fingerprint=model_fingerprint(model_dir),
        long_rope_after=(arch.rope_scaling.original_max_position_embeddings
                         if isinstance(arch.rope_scaling, LongRopeScaling) else None),
    )
    if config.lora.enable_lora:
        engine.lora = runner.lora = attach_lora(runner, config)
    logger.info(
        "engine ready in %.1fs: %s, %s, tensor_parallel_size %d, %d KV blocks of %d tokens (%.2f GiB), "
        "%d swap blocks, max_model_len %d",
        time.monotonic() - started, model_dir.name, runner.description, tp, num_blocks, block_size,
        runner.kv_cache_bytes / GiB, num_cpu_blocks, max_model_len,
    )
    return EngineParts(engine, runner, tokenizer, model_dir, eos)
