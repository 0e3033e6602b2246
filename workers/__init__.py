"""One replica: engine, model runner and the offline API.

``from workers import LLM, SamplingParams`` is the vLLM-style entry point.
Imports are lazy so that ``workers.engine`` (pure Python) loads without torch.
"""

from __future__ import annotations

from typing import Any

from cluster.shared.types import LoRARequest, SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from workers.llm import LLM

        return LLM
    raise AttributeError(name)
