"""One replica: engine, model runner and the offline API.

``from workers import LLM, SamplingParams`` is the vLLM-style entry point.
Imports are lazy so that ``workers.engine`` (pure Python) loads without torch.
"""

from __future__ import annotations

import os
from typing import Any

# Torch's CPU allocator puts allocations of 2 MiB and more (the weights) on transparent
# huge pages: a decode step's 540 MB of weights then spans ~270 TLB entries, not ~135,000.
# Batch-1 decode 3-6% faster and prefill 4-5% (default model, 2 cores, three alternated
# pairs of processes). Torch reads it once, at its first allocation: set before torch is
# imported (a process that imported torch first keeps its default); the environment wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from cluster.shared.types import LoRARequest, SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from workers.llm import LLM

        return LLM
    raise AttributeError(name)
