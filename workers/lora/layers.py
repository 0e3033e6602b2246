"""The LoRA side path of a linear layer, batched by adapter.

Every targetable :class:`~workers.model.linear.Linear` gets a
:class:`LoRALayer` that holds, per adapter slot, the shrink ``A`` and the
expand ``B`` of that layer (``adapter.py``). The runner says once per step
which rows of the flat batch belong to which slot (:class:`LoRABatch`); each
layer then adds, for each slot in the step, ``B(A(x[rows]))`` to those rows
of its output: one shrink and one expand per adapter, however many requests
use it (SGMV's grouping), and nothing for the base model's rows.

With the native linear backend a layer's side paths are one C call for every
adapter of the step (``kernels.py``: grouped shrink and expand, the rows of
one adapter sharing each weight load); otherwise, or for a side path wider
than the kernel takes, one shrink and one expand per adapter (the native GEMM
or ``F.linear``) with a gather and a scatter-add.

Exactness: either way each element is an FMA chain over its own row only
(our batch-invariant GEMM's order), times the adapter's scaling, so a
request's result never depends on its batch-mates, as on the dense path. A
16-bit adapter stays 16-bit in the grouped kernel's panels (widened in
registers); the per-adapter path widens it to float32 at load: the same
values, so the same bits either way.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from workers.model import lora_kernels as kernels
from workers.model import gemm

Kernel = Callable[[torch.Tensor], torch.Tensor]


class LoRABatch:
    """This step's rows per adapter slot (set by the runner before the forward)."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, Optional[torch.Tensor]]] = []  # (slot, rows; None: every row)
        self.rows = kernels.StepRows()  # the same groups as the native kernel reads them

    def set(self, row_slots: list[tuple[int, int]], num_rows: int, device: torch.device) -> None:
        """``row_slots``: ``(slot, rows)`` runs in batch order (slot -1: the base model)."""
        if not self.groups and all(slot < 0 for slot, _ in row_slots):
            return  # a base-only step after another: nothing to rebuild (every step runs this)
        rows: dict[int, list[int]] = {}
        start = 0
        for slot, n in row_slots:
            if slot >= 0:
                rows.setdefault(slot, []).extend(range(start, start + n))
            start += n
        assert start == num_rows, (start, num_rows)
        self.groups = [(slot, None if len(r) == num_rows else torch.tensor(r, dtype=torch.long, device=device))
                       for slot, r in rows.items()]
        if device.type == "cpu":
            self.rows.set(list(rows.items()))

    def clear(self) -> None:
        self.groups = []
        self.rows.set([])


class LoRALayer:
    """One linear layer's side paths, one per loaded adapter that targets it.

    ``native``: the side paths are our kernels (the native linear backend):
    ``kernels.NativeLayer`` when it builds, else the GEMM per adapter.
    """

    def __init__(self, batch: LoRABatch, native: bool) -> None:
        self.batch = batch
        self.native = native
        self.slots: dict[int, tuple[Kernel, Kernel, int]] = {}  # side paths the grouped kernel does not run (+ bytes)
        self.grouped: Optional[kernels.NativeLayer] = None  # built with the first side path
        self._lib = kernels.load() if native else None

    def set_slot(self, slot: int, a: torch.Tensor, b: torch.Tensor, scale: float = 1.0) -> None:
        """Installs ``(x @ a.T @ b.T) * scale`` as ``slot``'s side path."""
        self.install(slot, self.prepare(a, b, scale))

    def prepare(self, a: torch.Tensor, b: torch.Tensor, scale: float = 1.0) -> tuple[str, object]:
        """``(x @ a.T @ b.T) * scale`` packed for this layer's kernels, installed by
        ``install``; ``a`` and ``b`` float32, bfloat16 or float16 (kept so in the grouped
        kernel). Changes nothing here, so any thread may call it."""
        if self._lib is not None and kernels.NativeLayer.fits(a):
            layout = self.grouped or kernels.NativeLayer(self._lib, a.shape[1], b.shape[0])
            return "grouped", (a.shape[1], b.shape[0], layout.pack(a.contiguous(), b.contiguous(), scale))
        a, b = a.float(), b.float()
        expand = _kernel(b, self.native)
        if scale != 1.0:
            expand = _scaled(expand, scale)
        return "pair", (_kernel(a, self.native), expand, (a.numel() + b.numel()) * a.element_size())

    def install(self, slot: int, prepared: tuple[str, object]) -> None:
        """Makes ``prepare``'s result ``slot``'s side path (the engine thread)."""
        self.clear_slot(slot)
        kind, packed = prepared
        if kind == "grouped":
            in_features, out_features, panels = packed
            if self.grouped is None:
                self.grouped = kernels.NativeLayer(self._lib, in_features, out_features)
            self.grouped.install(slot, panels)
        else:
            self.slots[slot] = packed

    def clear_slot(self, slot: int) -> None:
        self.slots.pop(slot, None)
        if self.grouped is not None and slot in self.grouped.slots:
            self.grouped.clear_slot(slot)

    def num_bytes(self) -> int:
        """Bytes of the side paths installed here (the packed panels, or the pairs' weights)."""
        grouped = sum(t.numel() * t.element_size() for packed in (self.grouped.slots.values() if self.grouped else ())
                      for t in packed if isinstance(t, torch.Tensor))
        return grouped + sum(pair[2] for pair in self.slots.values())

    def add_to(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` plus each of this step's adapters' delta on its rows (in place)."""
        if not self.batch.groups:
            return out
        if self.grouped is not None:
            if x.dim() != 2 or x.stride(1) != 1 or x.dtype != torch.float32:
                x = x.reshape(-1, self.grouped.k).contiguous().float()
            assert out.dim() == 2 and out.stride(1) == 1 and out.dtype == torch.float32, "float32 rows"
            self.grouped.add_to(self.batch.rows, x, out)
        for slot, rows in self.batch.groups:
            pair = self.slots.get(slot)
            if pair is None:  # grouped above, or this adapter does not target this layer
                continue
            shrink, expand, _ = pair
            if rows is None:
                out.add_(expand(shrink(x)))
            else:
                out.index_add_(0, rows, expand(shrink(x.index_select(0, rows))))
        return out


def co_locate(prepared: dict[str, tuple[str, object]]) -> dict[str, tuple[str, object]]:
    """One adapter's ``prepare`` results (in the order a step runs its layers)
    with every grouped side path's panels in one buffer (``kernels.co_locate``)."""
    grouped = [m for m, (kind, _) in prepared.items() if kind == "grouped"]
    if not grouped:
        return prepared
    moved = kernels.co_locate([prepared[m][1][2] for m in grouped])
    out = dict(prepared)
    for m, panels in zip(grouped, moved, strict=True):
        in_features, out_features, _ = prepared[m][1]
        out[m] = ("grouped", (in_features, out_features, panels))
    return out


def _scaled(kernel: Kernel, scale: float) -> Kernel:
    return lambda x: kernel(x).mul_(scale)


def _kernel(weight: torch.Tensor, native: bool) -> Kernel:
    weight = weight.contiguous()
    if native:
        lib = gemm.load()
        if lib is not None:
            return gemm.PackedWeight(weight, None, lib).matmul_no_bias
    return lambda x: F.linear(x, weight)
