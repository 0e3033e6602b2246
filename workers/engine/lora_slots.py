"""The scheduler's limit on adapters in a step (``max_loras``): a sequence
starts (or resumes) only if its adapter already runs, or fewer than
``max_loras`` distinct adapters do. Base-model sequences always may."""

from __future__ import annotations

from typing import Iterable

from workers.engine.sequence import Sequence


def adapter_fits(seq: Sequence, running: Iterable[Sequence], max_loras: int) -> bool:
    """Whether ``seq``'s adapter may join the running sequences' adapters."""
    if seq.lora is None:
        return True
    active = {s.lora.slot for s in running if s.lora is not None}
    return seq.lora.slot in active or len(active) < max_loras


def slots_in_use(sequences: Iterable[Sequence]) -> set[int]:
    """Adapter slots some unfinished sequence holds (never evicted)."""
    return {s.lora.slot for s in sequences if s.lora is not None}
