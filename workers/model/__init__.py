"""Model code: architecture config, Llama-family layers, loading (safetensors, GGUF)."""

from workers.model.config import Llama3RopeScaling, ModelArchConfig, SUPPORTED_ARCHITECTURES
from workers.model.llama import LlamaForCausalLM
from workers.model.loader import (
    cache_root,
    default_gguf_path,
    iter_weights,
    load_model,
    model_fingerprint,
    resolve_dtype,
    resolve_model,
)

__all__ = [
    "Llama3RopeScaling",
    "LlamaForCausalLM",
    "ModelArchConfig",
    "SUPPORTED_ARCHITECTURES",
    "cache_root",
    "default_gguf_path",
    "iter_weights",
    "load_model",
    "model_fingerprint",
    "resolve_dtype",
    "resolve_model",
]
