"""The frozen configuration tree, read once at the entry points.

Knob names follow vLLM (block_size, max_num_seqs, max_num_batched_tokens,
enable_chunked_prefill, enable_prefix_caching, swap_space, preemption_mode,
tensor_parallel_size, enforce_eager, dtype, seed) so users find what they
know. Leaves of the program receive plain values, never this tree.

    engine.py    one replica's engine: EngineConfig with its cache, scheduler
                 and parallel sections; EngineConfig.from_kwargs reads the flat
                 keyword arguments of LLM(...) and the CLI
    cluster.py   the cluster around the engines: ClusterConfig, RouterConfig
    models.py    one served model (ModelConfig: engine, replicas, routing) and
                 AutoscalingConfig; ClusterConfig.models lists several
    loading.py   strict reading of the whole tree from a mapping or a YAML file
                 (``prefixserve up --config``, the RayService's serveConfigV2
                 args): unknown keys are errors named by their full path
"""

from cluster.shared.config.cluster import (REASONING_PARSERS, REPLICA_TRANSPORTS, TOOL_CALL_PARSERS, ClusterConfig,
                                           RouterConfig)
from cluster.shared.config.models import DIRECTORY_LOOKUPS, ROUTING_POLICIES, AutoscalingConfig, ModelConfig
from cluster.shared.config.engine import (
    ATTENTION_BACKENDS,
    DTYPES,
    LINEAR_BACKENDS,
    KV_CACHE_DTYPES,
    QUANTIZATION_METHODS,
    PREEMPTION_MODES,
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    SPECULATIVE_METHODS,
)
from cluster.shared.config.lora import LoRAConfig
from cluster.shared.config.structured import STRUCTURED_BACKENDS, StructuredOutputsConfig

__all__ = [
    "ATTENTION_BACKENDS", "DTYPES", "KV_CACHE_DTYPES", "LINEAR_BACKENDS", "PREEMPTION_MODES", "QUANTIZATION_METHODS",
    "DIRECTORY_LOOKUPS", "REPLICA_TRANSPORTS", "ROUTING_POLICIES", "SPECULATIVE_METHODS", "STRUCTURED_BACKENDS",
    "TOOL_CALL_PARSERS", "REASONING_PARSERS", "AutoscalingConfig", "CacheConfig", "ClusterConfig", "EngineConfig",
    "LoRAConfig", "ModelConfig", "ParallelConfig",
    "RouterConfig", "SchedulerConfig", "SpeculativeConfig", "StructuredOutputsConfig",
]
