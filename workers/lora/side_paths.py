"""Where adapters' weights live: the side paths of one process's layers, and,
with tensor parallelism, of every rank's.

The engine's :class:`~workers.lora.manager.LoRAManager` decides which adapter
goes to which slot and which are evicted; the objects here only carry that
out, in two steps so that a refused adapter changes nothing anywhere:

1. ``stage(name, path)`` reads and checks the adapter and keeps it aside
   (``ValueError``: refused, nothing changed);
2. ``commit(slot, evict)`` clears the evicted slots and installs the staged
   adapter in ``slot``; ``drop(slots)`` clears slots.

:class:`AdapterSlots` is one process's layers. On a tensor-parallel rank it
holds the rank's shard of each side path, cut like the base weight of the
layer it attaches to (``workers/model/tp.py``)::

    layer                       A [R, in]                 B [out, R]
    qkv_proj, gate_up_proj      whole                     each part's rows (q, k, v / gate, up)
    (column-parallel)                                      cut as the base weight's part
    o_proj, down_proj           the rank's input columns  whole
    (row-parallel)

A row-parallel layer's side path runs in ``Linear.matmul`` on the rank's
input slice, before the all-reduce: each rank adds ``B A_r x_r`` to its
partial product, and the sum over ranks is ``B A x``, added once.

:class:`RankAdapterSlots` is the driver's handle on every rank's
``AdapterSlots``: each step goes to all ranks, so every rank holds the same
adapters in the same slots. Each rank reads the adapter folder itself (its
weights never cross the object store) and checks it against the full model's
shapes (a ``meta``-device copy of the model), so every rank refuses the same
adapters with the same message.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Iterable, Optional

import torch
from torch import nn

from workers.lora.adapter import TARGETS, LayerDelta, LoRAAdapter, load_adapter
from workers.lora.layers import LoRABatch, LoRALayer, co_locate
from workers.model.linear import Linear
from workers.model.tp import shard_checkpoint_tensor

logger = logging.getLogger(__name__)

# The parts of a fused column-parallel layer, and the parent's method that gives their rows.
_PARTS = {"qkv_proj": (("q", "k", "v"), "qkv_shard_rows"), "gate_up_proj": (("gate", "up"), "gate_up_shard_rows")}


class AdapterSlots:
    """The LoRA side paths of this process's model, by adapter slot.

    Args:
        model: The finalized model, or one rank's shard of it. Its native
            decoder (``native_decoder.py``) runs the side paths itself; a
            ``torch.compile``d decoder would bypass them and is refused.
        max_lora_rank: The largest rank an adapter may have.
        native: Use the native GEMM for the side paths (the linear backend
            is ``native``).
    """

    def __init__(self, model: nn.Module, max_lora_rank: int, native: bool) -> None:
        self.model = model
        self.max_lora_rank = max_lora_rank
        self.batch = LoRABatch()
        self.layers: dict[str, LoRALayer] = {}
        for name, module in model.named_modules():
            if (isinstance(module, Linear) and name.rsplit(".", 1)[-1] in TARGETS and ".experts." not in name
                    and ".shared_expert" not in name):
                module.lora = self.layers[name] = LoRALayer(self.batch, native)
        if getattr(model, "compiled", None) is not None:
            raise ValueError("enable_lora runs eagerly: drop enforce_eager=False")
        self.tp = getattr(model, "tp", None)  # a TPContext on a tensor-parallel rank
        # Adapters are checked against the full model's shapes, then cut to the rank's shard.
        self.reference = model if self.tp is None else _full_model_on_meta(model)
        self._staged: Optional[dict[str, Any]] = None  # module -> its layer's prepared side path

    def stage(self, name: str, path: str) -> LoRAAdapter:
        """Reads and checks an adapter and keeps its (sliced) side paths for ``commit``.

        Returns:
            The adapter without its tensors (what the manager keeps).

        Raises:
            ValueError: The adapter is refused (``adapter.load_adapter``).
        """
        self._staged = None
        return self.stage_read(self.read(name, path))

    def read(self, name: str, path: str) -> LoRAAdapter:
        """Reads, checks and slices an adapter; touches no slot, so any thread
        may call it (the replica reads ahead of the engine thread)."""
        adapter = load_adapter(name, path, self.reference, self.max_lora_rank)
        deltas = adapter.deltas if self.tp is None else {m: self._shard(m, d) for m, d in adapter.deltas.items()}
        logger.info("LoRA adapter %s read from %s: rank %d, %d layers, %.1f MiB%s", name, path, adapter.rank,
                    len(deltas), sum(LoRAAdapter.delta_bytes(d) for d in deltas.values()) / 2**20,
                    f" on rank {self.tp.rank}" if self.tp is not None else "")
        # Packed here, not at commit; in the model's layer order, the order a step reads them (co_locate).
        prepared = co_locate({m: self.layers[m].prepare(deltas[m].a, deltas[m].b, deltas[m].scale)
                              for m in self.layers if m in deltas})
        return dataclasses.replace(adapter, deltas=deltas, prepared=prepared)

    def stage_read(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """Keeps an adapter ``read`` returned for ``commit``; returns it without its tensors."""
        self._staged = adapter.prepared
        return dataclasses.replace(adapter, deltas={}, prepared={})

    def commit(self, slot: int, evict: Iterable[int] = ()) -> None:
        """Clears ``evict``'s slots, then installs the staged adapter in ``slot``."""
        assert self._staged is not None, "stage() first"
        self.drop(evict)
        for module, prepared in self._staged.items():
            self.layers[module].install(slot, prepared)
        self._staged = None

    def drop(self, slots: Iterable[int]) -> None:
        """Clears the side paths of ``slots`` in every layer."""
        for slot in slots:
            for layer in self.layers.values():
                layer.clear_slot(slot)

    def num_bytes(self) -> int:
        """Bytes of every installed side path in this process (what an unload or eviction frees)."""
        return sum(layer.num_bytes() for layer in self.layers.values())

    def _shard(self, module: str, delta: LayerDelta) -> LayerDelta:
        """The rank's piece of a full side path (the module docstring's table)."""
        assert self.tp is not None
        head_dim = self.model.arch.head_dim
        leaf = module.rsplit(".", 1)[-1]
        layer = self.model.get_submodule(module)
        if leaf in _PARTS:  # column-parallel: each part's rows as tp.py cuts the weight's
            parts, rows_of = _PARTS[leaf]
            parent = self.reference.get_submodule(module.rsplit(".", 1)[0])
            b = torch.cat([shard_checkpoint_tensor(self.tp.shard, head_dim, f"{module}.weight", part,
                                                   delta.b.narrow(0, *getattr(parent, rows_of)(part)))
                           for part in parts])
            a = delta.a
        else:  # row-parallel: the rank's input columns
            a = shard_checkpoint_tensor(self.tp.shard, head_dim, f"{module}.weight", "", delta.a)
            b = delta.b
        assert a.shape[1] == layer.in_features and b.shape[0] == layer.out_features, (module, a.shape, b.shape)
        return LayerDelta(a.contiguous(), b.contiguous(), delta.scale)


class RankAdapterSlots:
    """Every tensor-parallel rank's ``AdapterSlots``, driven as one.

    Args:
        runner: The ``TensorParallelRunner``; its ranks already attached
            their ``AdapterSlots`` (``RankWorker.lora``).
    """

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def stage(self, name: str, path: str) -> LoRAAdapter:
        """Every rank stages its shard; the adapter as rank 0 read it.

        Raises:
            ValueError: The ranks refused the adapter.
        """
        adapters = self.runner.call_ranks("call_lora", "stage", name, path)
        assert len({a.content_hash for a in adapters}) == 1, "the ranks read different adapter files"
        return adapters[0]

    def commit(self, slot: int, evict: Iterable[int] = ()) -> None:
        self.runner.call_ranks("call_lora", "commit", slot, list(evict))

    def drop(self, slots: Iterable[int]) -> None:
        slots = list(slots)
        if slots:
            self.runner.call_ranks("call_lora", "drop", slots)


def _full_model_on_meta(model: nn.Module) -> nn.Module:
    """The whole model's modules (no tensor parallelism) on the ``meta`` device: its shapes, no memory."""
    from workers.model.llama import LlamaForCausalLM

    backend = next(m.attn_backend for m in model.modules() if hasattr(m, "attn_backend"))
    with torch.device("meta"):
        return LlamaForCausalLM(model.arch, backend)
