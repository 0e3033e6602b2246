"""The engine's config: one replica's model, KV cache, scheduler and tensor-parallel group, with vLLM's knob names.

``EngineConfig.from_kwargs`` takes the flat keyword arguments users pass to ``LLM(...)`` or the CLI and rejects
unknown keys by name; ``flat()`` is its inverse.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, Optional

from cluster.shared.config.mapping import check_keys, read_mapping
from cluster.shared.config.lora import LoRAConfig
from cluster.shared.config.structured import StructuredOutputsConfig

PREEMPTION_MODES = ("swap", "recompute")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash_attn")
LINEAR_BACKENDS = ("auto", "native", "onednn", "torch")
QUANTIZATION_METHODS = ("gguf", "int8", "int4", "w8a8", "gptq", "awq", "gguf-a8")
KV_CACHE_DTYPES = ("auto", "int8")
DTYPES = ("auto", "float32", "float16", "bfloat16")
SPECULATIVE_METHODS = ("ngram", "draft_model", "medusa", "eagle", "eagle3")
_SPEC_PLANNED = ("mlp_speculator",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, vLLM's ``speculative_config`` (a mapping).

    Attributes:
        method: ``ngram`` (prompt lookup: no extra model), ``draft_model``
            (a smaller model with the target's vocabulary proposes greedily,
            with its own paged KV cache in the same replica) or ``medusa``
            (heads on the target's last hidden state, ``model`` their folder:
            ``prefixserve train-heads`` writes one) or ``eagle`` / ``eagle3`` (an EAGLE-1 draft
            layer over the target's hidden states, EAGLE-3's over three layers' features, ``model``
            its folder in vLLM's layout; ``train-heads --method eagle | eagle3`` writes one).
        num_speculative_tokens: Most tokens proposed per sequence and step.
        prompt_lookup_min / prompt_lookup_max: n-gram sizes matched, longest
            first (``ngram``).
        model: The draft model (folder or ``.gguf``; ``draft_model``; None
            is the target's own model, cut to ``draft_num_layers``), or the
            Medusa heads' folder (``medusa``), or the EAGLE draft's (``eagle``, ``eagle3``).
        draft_num_layers: Keep only the first N decoder layers of the draft
            (self-speculation with a layer-truncated copy).
        adaptive: Size each proposal from the request's measured acceptance
            and the measured cost of a step (``workers/engine/spec_decode.py``),
            proposing nothing where it does not pay; False always proposes up
            to ``num_speculative_tokens`` when the proposer has that many.
        num_candidates: Candidate continuations verified together as a tree
            (SpecInfer): the n-gram proposer's distinct continuations of
            earlier matches, the Medusa heads' likeliest top-k combinations, an EAGLE draft's
            dynamic tree (EAGLE-2). 1 (the default) verifies one chain. Trees need the ``torch``
            attention backend (the CPU default) and ``ngram``, ``medusa``, ``eagle`` or ``eagle3``.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    adaptive: bool = True
    model: Optional[str] = None
    draft_num_layers: Optional[int] = None
    num_candidates: int = 1

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            planned = " (not supported yet)" if self.method in _SPEC_PLANNED else ""
            raise ValueError(f"speculative_config method must be one of {SPECULATIVE_METHODS}, got "
                             f"{self.method!r}{planned}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"speculative_config num_speculative_tokens must be in 1..16, got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.method == "ngram" and (self.model is not None or self.draft_num_layers is not None):
            raise ValueError("speculative_config model / draft_num_layers are for method 'draft_model'")
        if self.method == "medusa" and (self.model is None or self.draft_num_layers is not None):
            raise ValueError("speculative_config method 'medusa' needs model: the heads' folder "
                             "(prefixserve train-heads writes one); draft_num_layers is for 'draft_model'")
        if self.method in ("eagle", "eagle3") and (self.model is None or self.draft_num_layers is not None):
            raise ValueError(f"speculative_config method '{self.method}' needs model: the EAGLE draft's folder "
                             f"(prefixserve train-heads --method {self.method} writes one); draft_num_layers is for "
                             "'draft_model'")
        if self.method == "draft_model" and self.model is None and self.draft_num_layers is None:
            raise ValueError("speculative_config method 'draft_model' needs model (a smaller model with the "
                             "target's tokenizer) or draft_num_layers (a layer-truncated copy of the target)")
        if not 1 <= self.num_candidates <= 8:
            raise ValueError(f"speculative_config num_candidates must be in 1..8, got {self.num_candidates}")
        if self.num_candidates > 1 and self.method == "draft_model":
            raise ValueError("speculative_config num_candidates > 1 (a tree of candidates) is for methods 'ngram', "
                             "'medusa', 'eagle' and 'eagle3' (EAGLE-2's dynamic trees); 'draft_model' proposes one chain")
        if self.draft_num_layers is not None and self.draft_num_layers < 1:
            raise ValueError(f"speculative_config draft_num_layers must be >= 1, got {self.draft_num_layers}")

    @classmethod
    def from_mapping(cls, mapping: Any) -> "SpeculativeConfig":
        """From ``speculative_config`` as users give it (a dict, or its JSON).

        Raises:
            ValueError: Not a mapping, an unknown key (named), or a bad value.
        """
        mapping = read_mapping(mapping, "speculative_config", '{"method": "ngram", "num_speculative_tokens": 4}')
        if mapping.get("method", cls.method) in _SPEC_PLANNED:  # before its keys, which we do not know yet
            raise ValueError(f"speculative_config method {mapping['method']!r} is not supported yet: use one of "
                             f"{SPECULATIVE_METHODS}")
        check_keys(mapping, cls, "speculative_config")
        return cls(**mapping)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache.

    Attributes:
        block_size: Tokens per KV block (the unit of prefix caching).
        num_kv_blocks: Device blocks; ``None`` sizes the pool from
            ``kv_cache_memory`` (CPU) or ``gpu_memory_utilization`` (GPU).
        kv_cache_memory: GiB of KV cache on CPU when ``num_kv_blocks`` is None.
        gpu_memory_utilization: Fraction of GPU memory for weights + KV.
        swap_space: GiB of CPU memory for blocks of preempted sequences.
        enable_prefix_caching: Reuse full blocks whose hash chain matches.
        kv_cache_dtype: ``auto`` (the model's dtype) or ``int8`` (one scale
            per token and head, ``workers/model/attention/kv_int8.py``; CPU,
            the torch attention backend): about 3.8x the blocks of float32.
        kv_transfer_max_concurrent: KV fetches from other replicas, and exports to them, a replica runs
            at once; one more is refused at once (its request prefills), never queued (docs/KV_TRANSFER.md).
        kv_transfer_timeout_s: Seconds a KV fetch waits for the holder before its request prefills
            instead, and the time bound of a warm start and of a hand-over.
        kv_warm_start_bytes: KV a joining replica pulls of the hottest prefixes before it serves; 0: off.
        kv_handover_bytes: KV a replica being scaled down pushes of its hottest prefixes to a survivor; 0: off.
        kv_cache_prefault: Commit the CPU KV cache's pages at start, not at each block's first write (~15% of a
            fresh replica's prefill, docs/ARCHITECTURE.md); off: memory grows with the blocks used.
    """

    block_size: int = 16
    num_kv_blocks: Optional[int] = None
    kv_cache_memory: float = 2.0
    gpu_memory_utilization: float = 0.9
    swap_space: float = 1.0
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    kv_transfer_max_concurrent: int = 2
    kv_transfer_timeout_s: float = 10.0
    kv_warm_start_bytes: int = 64 * 2**20
    kv_handover_bytes: int = 64 * 2**20
    kv_cache_prefault: bool = True

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES} (no fp8), got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1 or None, got {self.num_kv_blocks}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.kv_transfer_max_concurrent < 1 or self.kv_transfer_timeout_s <= 0 or min(
                self.kv_warm_start_bytes, self.kv_handover_bytes) < 0:
            raise ValueError("kv_transfer_max_concurrent must be >= 1, kv_transfer_timeout_s > 0, kv_warm_start_bytes "
                             f"and kv_handover_bytes >= 0, got {self.kv_transfer_max_concurrent}, "
                             f"{self.kv_transfer_timeout_s}, {self.kv_warm_start_bytes} and {self.kv_handover_bytes}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching.

    Attributes:
        max_num_seqs: Most sequences in one step.
        max_num_batched_tokens: Token budget of one step (prefill chunks plus
            one token per decoding sequence).
        enable_chunked_prefill: Split long prompts across steps so decodes are
            not starved. When off, a prompt is admitted only whole.
        preemption_mode: ``swap`` (copy blocks to CPU swap space, falling back
            to recompute when swap is full) or ``recompute``.
        max_waiting_requests: Admission bound of a serving replica (no vLLM
            equivalent; like SGLang's ``max_queued_requests``): it holds at
            most ``max_num_seqs + max_waiting_requests`` unfinished requests
            and rejects more at once with ``ReplicaOverloadedError`` (the
            router answers RESOURCE_EXHAUSTED / HTTP 429 with a retry hint).
            ``None`` is unbounded. The offline ``LLM`` queues everything.
        stream_interval: Tokens a serving replica streams per chunk after a
            request's first (vLLM's and SGLang's ``stream_interval``); the
            first token and the finish leave at once. 1 (the default) sends
            every step's tokens as they come; more sends fewer, larger
            chunks (less per-token work in the replica, router and client
            under load, burstier streams). Outputs already queued when the
            stream is read are always sent together.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "swap"
    max_waiting_requests: Optional[int] = 256
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({self.max_num_seqs}): every running sequence needs a token of budget each step")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0 or None (unbounded), got {self.max_waiting_requests}")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism and the forward's CPU threads.

    Attributes:
        tensor_parallel_size: Ranks of the replica's tensor-parallel group
            (one Ray actor each, joined by torch.distributed: gloo on CPU,
            NCCL on GPU); 1 runs the model in the replica itself.
        cpu_threads: Torch threads of the forward on CPU, per process (the
            replica, or each tensor-parallel rank). None picks them: a
            process that reserves whole CPUs uses as many
            (``replica_num_cpus`` 4: 4 threads); one that reserves a fraction
            (several replicas packed on a small machine) uses the machine's
            cores split over the replicas, or over the ranks of its group.
            Ray alone would give a fractional actor 1 thread
            (``OMP_NUM_THREADS=1``), half the speed of a 2-core machine.
    """

    tensor_parallel_size: int = 1
    cpu_threads: Optional[int] = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1 or None (picked from the CPUs reserved), "
                             f"got {self.cpu_threads}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything one replica's engine needs.

    Attributes:
        model: Local folder (config.json + safetensors + tokenizer.json) or a
            ``.gguf`` file; ``None`` means the packaged default model.
        tokenizer: Folder or tokenizer.json; defaults to the model's.
        dtype: Compute dtype; ``auto`` is float32 on CPU, bfloat16 on GPU.
        max_model_len: Longest prompt + output; ``None`` takes the model's
            ``max_position_embeddings``.
        seed: Seed of the sampling of requests that bring no seed.
        attention_backend: ``auto`` picks flash_attn on GPU when installed,
            else torch.
        linear_backend: Kernel of the linear layers (``workers/model/linear.py``):
            ``auto`` (our batch-invariant native GEMM on CPU, cuBLAS on GPUs),
            ``native``, ``onednn`` or ``torch``.
        quantization: Weight-only quantization of the linear layers
            (``workers/model/quant/``): ``gguf`` (a .gguf model's own
            quantized tensors), ``gguf-a8`` (the same tensors against
            activations quantized to int8 per 32 inputs at run time, as
            llama.cpp computes them: faster, not exact to the float run),
            ``int8`` (per channel), ``int4`` (per group),
            ``w8a8`` (SmoothQuant, calibrated at load on text shipped with
            Python), ``gptq`` / ``awq`` (a 4-bit checkpoint's packed layers;
            found in its config.json when None); None keeps float weights.
            CPU, float32.
        quantization_group_size: Inputs per group of ``int4``: 32 (the
            default; Q4_1's grid), 64 or 128 (GPTQ's grid, rounded to
            nearest): fewer bytes, lower quality (docs/QUANTIZATION.md).
        batch_invariant: Guarantee that a request's outputs (tokens and
            logprobs, bitwise) never depend on what else is in its steps,
            including how its prompt's prefill is chunked: every attention
            query, prefill or decode, runs the same per-query kernel. Without
            it (the default, faster prefill) outputs are already independent
            of batch-mates except through prefill chunk boundaries. CPU,
            float32, ``linear_backend`` native.
        enforce_eager: Run the model eagerly. False compiles the decoder stack
            with ``torch.compile`` on CPU (``workers/model/compiled.py``; the
            native linear backend, no tensor parallelism), and on a GPU
            replays decode steps as CUDA graphs (``workers/cuda_graphs.py``;
            the triton attention backend, no tensor parallelism). The default
            stays eager:
            on CPU the native fused kernels already do what inductor would
            fuse, and measured steps are no faster compiled while the first
            steps pay ~30 s of compilation (``bench latency``).
        device: ``cpu`` or ``cuda``; ``None`` picks cuda when available.
        speculative_config: Speculative decoding (``SpeculativeConfig``: a
            mapping or its JSON, e.g. ``{"method": "ngram",
            "num_speculative_tokens": 4}``); None turns it off.
        structured_outputs_config: How output constraints are compiled and
            enforced (``StructuredOutputsConfig``: a mapping or its JSON);
            None takes the defaults.
    """

    model: Optional[str] = None
    tokenizer: Optional[str] = None
    dtype: str = "auto"
    max_model_len: Optional[int] = None
    seed: int = 0
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    batch_invariant: bool = False
    quantization: Optional[str] = None
    quantization_group_size: Optional[int] = None
    enforce_eager: bool = True
    device: Optional[str] = None
    speculative_config: Optional[dict] = None
    structured_outputs_config: Optional[dict] = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS} or None, got "
                             f"{self.quantization!r}")
        if self.quantization_group_size is not None and self.quantization != "int4":
            raise ValueError("quantization_group_size applies to quantization='int4' only")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {self.linear_backend!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.structured_outputs_config is not None:
            parsed = StructuredOutputsConfig.from_mapping(self.structured_outputs_config)
            object.__setattr__(self, "structured_outputs_config", dataclasses.asdict(parsed))
        if self.speculative_config is not None:
            spec = SpeculativeConfig.from_mapping(self.speculative_config)
            object.__setattr__(self, "speculative_config", dataclasses.asdict(spec))  # JSON given: a dict from now
            if spec.method in ("medusa", "eagle", "eagle3") and self.parallel.tensor_parallel_size > 1:
                raise ValueError(f"speculative_config method {spec.method!r} runs with tensor_parallel_size 1: use "
                                 "'ngram' or 'draft_model' with tensor parallelism")
            if spec.num_candidates > 1 and (self.attention_backend not in ("auto", "torch")
                                            or (self.attention_backend == "auto" and self.device == "cuda")):
                raise ValueError("speculative_config num_candidates > 1 (tree verification) needs "
                                 "attention_backend 'torch' (the CPU default); set num_candidates 1 or "
                                 f"attention_backend 'torch' (now {self.attention_backend!r}, device {self.device!r})")

    @property
    def structured_outputs(self) -> StructuredOutputsConfig:
        """The parsed ``structured_outputs_config`` (defaults when None)."""
        return StructuredOutputsConfig(**(self.structured_outputs_config or {}))

    @property
    def speculative(self) -> Optional[SpeculativeConfig]:
        """The parsed ``speculative_config`` (None: off)."""
        return None if self.speculative_config is None else SpeculativeConfig(**self.speculative_config)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Builds the tree from flat vLLM-style engine arguments.

        Raises:
            ValueError: For an unknown key, naming it and the closest known one.
        """
        sections = ENGINE_SECTIONS
        top_names = {f.name for f in dataclasses.fields(cls)} - set(sections)
        owner = {f.name: sec for sec, klass in sections.items() for f in dataclasses.fields(klass)}
        top: dict[str, Any] = {}
        nested: dict[str, dict[str, Any]] = {sec: {} for sec in sections}
        for key, value in kwargs.items():
            if key in top_names:
                top[key] = value
            elif key in owner:
                nested[owner[key]][key] = value
            else:
                known = sorted(top_names | set(owner))
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; known arguments: {', '.join(known)}"
                raise ValueError(f"unknown engine argument {key!r}{hint}")
        built = {sec: klass(**nested[sec]) for sec, klass in sections.items()}
        return cls(**top, **built)

    def flat(self) -> dict[str, Any]:
        """Returns the flat engine arguments (inverse of ``from_kwargs``)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for sec in ENGINE_SECTIONS:
            out.update(dataclasses.asdict(out.pop(sec)))
        return out


# The sections of EngineConfig, by field name, whose knobs are also given flat.
ENGINE_SECTIONS = {"cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig, "lora": LoRAConfig}
