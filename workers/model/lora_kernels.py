"""The native LoRA kernel (``csrc/lora_f32.c``): every adapter's side path of
one linear layer in one C call, SGMV's grouping without a Python loop.

Layout, per layer and adapter slot (built once, at load)::

    A [R, K]  ──▶  at: rank panels [K][w], w = BW (= 2 VL) but the last:
                   R padded to the vector width VL, each panel streamed once
    B [N, R]  ──▶  bt: output panels, one per BW outputs (N padded): [hi - lo][BW]
                   for the ranks [lo, hi) whose B entries are not all zero
                   there (ranges), at offsets offs

A slot's A and B keep the adapter's saved format: float32, or bfloat16 /
float16, widened to float32 in the kernel's registers (exact), so a 16-bit
adapter is read at half the bytes with the float32 path's arithmetic.
bfloat16 panels interleave pairs of their reduction index (``_paired``: A's
rows k, k + 1 and B's ranks j, j + 1 element by element, an odd count padded
with zeros the kernel never multiplies), so the kernel widens two vectors from
one load with a shift and a mask. B is
stored without the scaling; the kernel multiplies the expand's chain by it
(PEFT's ``lora_B(lora_A(x)) * scaling``).

A fused layer's B is block-diagonal (q/k/v, gate/up: ``adapter.py``), so an
output panel holds only its part's ranks and a step reads no zero block; the
products skipped are exact zeros (adding them leaves an FMA chain's value as
it is).

One adapter's panels, every layer's A and B, lie in one buffer in the order a
decode step reads them (:func:`co_locate`), on transparent huge pages where
Linux offers them (``madvise``): a step then streams each adapter as one run of
memory instead of hundreds of 10-100 KB allocations, and pays no TLB miss per
4 KB page (measured on a loaded 2-core machine, one thread, thread CPU time:
the kernel's 120 calls of a batch-8 decode step on 8 bfloat16 adapters of the
default model took 5.9-6.4 ms on scattered 4 KB pages, 4.3-4.8 ms co-located
on huge pages; docs/BENCHMARKS.md).

A step (:class:`StepRows`): the flat batch's rows grouped by slot, built once
per step and shared by every layer. The kernel runs each group's shrink
``t = A x`` and then its expand ``y += B t``, four rows of one adapter per
weight load, the blocks split over the threads. Each element is one FMA chain
in ascending order from zero (the expand's then added to ``y``), as our GEMM
computes it, so a row's result never depends on its batch-mates.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Optional, Sequence

import torch

from workers.model import native

_P, _L = ctypes.c_void_p, ctypes.c_long
_SIGNATURES = {"lora_add_f32": [_P, _P, _P, _L, _P, _L]}
MAX_RPAD = 1024  # ranks of one layer's side path (fused parts summed); larger ones run on torch
# The weight formats the kernel reads (csrc/lora_f32.c FMT_*).
FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


HUGE_PAGE = 2 << 20
ALIGN = 64  # each panel array starts on a cache line


def arena(num_bytes: int) -> torch.Tensor:
    """A zeroed uint8 buffer of ``num_bytes``; from ``HUGE_PAGE`` up, a private
    anonymous mapping advised for transparent huge pages and aligned to them
    (where the platform has ``MADV_HUGEPAGE``; the tensor keeps the mapping alive)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if num_bytes < HUGE_PAGE or advice is None or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.zeros(num_bytes, dtype=torch.uint8)
    size = -(-num_bytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to align the start
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(advice)
    except OSError:  # THP off in this kernel: plain pages, still one run
        pass
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = (-whole.data_ptr()) % HUGE_PAGE
    return whole[start : start + num_bytes]


def co_locate(packs: list[tuple]) -> list[tuple]:
    """``pack``'s results with their A and B panels copied, in the given order,
    into one :func:`arena` (same values, same layout: the kernel reads the same bits)."""
    sizes = [[-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in packed[:2]] for packed in packs]
    buffer = arena(sum(map(sum, sizes)))
    out, offset = [], 0
    for packed, size in zip(packs, sizes, strict=True):
        moved = []
        for t, n in zip(packed[:2], size, strict=True):
            view = buffer[offset : offset + t.numel() * t.element_size()].view(t.dtype)
            view.copy_(t.reshape(-1))
            moved.append(view)
            offset += n
        out.append((*moved, *packed[2:]))
    return out


def load(flags: Sequence[str] = native.FLAGS) -> Optional[ctypes.CDLL]:
    """The built kernel, or None (no compiler, no AVX2 + FMA, or a failed build)."""
    lib = native.build("lora_f32", native.source("lora_f32.c"), flags=flags, signatures=_SIGNATURES)
    if lib is not None:
        lib.lora_vector_width.restype = ctypes.c_int
        lib.lora_block_width.restype = ctypes.c_int
    return lib


def _paired(panel: torch.Tensor, pairs: bool) -> torch.Tensor:
    """``panel`` [reduction (even with pairs), width] as the kernel reads it: with
    ``pairs``, rows 2i and 2i + 1 interleaved element by element ([n / 2][width][2])."""
    if not pairs:
        return panel.contiguous()
    n, width = panel.shape
    return panel.reshape(n // 2, 2, width).transpose(1, 2).contiguous()


class _LayerC(ctypes.Structure):
    _fields_ = [("k", _L), ("n", _L), ("npad", _L), ("max_rpad", _L), ("num_slots", _L), ("at", _P), ("bt", _P),
                ("rpad", _P), ("ranges", _P), ("offs", _P), ("fmt", _P), ("scale", _P)]


class _BatchC(ctypes.Structure):
    _fields_ = [("num_groups", _L), ("group_slot", _P), ("group_start", _P), ("rows", _P), ("scratch", _P),
                ("ldt", _L)]


class StepRows:
    """This step's rows per slot as the kernel reads them (one per step, every layer)."""

    def __init__(self) -> None:
        self.c = _BatchC()
        self._keep: tuple = ()
        self._scratch = torch.empty(0)

    def set(self, groups: list[tuple[int, list[int]]]) -> None:
        """``groups``: ``(slot, row indices)`` per adapter of the step (none: the kernel adds nothing)."""
        slots = torch.tensor([slot for slot, _ in groups], dtype=torch.long)
        starts = torch.tensor([0] + [len(r) for _, r in groups], dtype=torch.long).cumsum(0)
        rows = torch.tensor([i for _, r in groups for i in r], dtype=torch.long)
        need = max(1, int(starts[-1])) * MAX_RPAD
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need)
        self._keep = (slots, starts, rows)
        self.c.num_groups = len(groups)
        self.c.group_slot, self.c.group_start, self.c.rows = slots.data_ptr(), starts.data_ptr(), rows.data_ptr()
        self.c.scratch, self.c.ldt = self._scratch.data_ptr(), MAX_RPAD


class NativeLayer:
    """One linear layer's side paths in the kernel's layout, by slot."""

    def __init__(self, lib: ctypes.CDLL, in_features: int, out_features: int) -> None:
        self.lib = lib
        self.vl, self.bw = lib.lora_vector_width(), lib.lora_block_width()
        self.k, self.n = in_features, out_features
        self.npad = -(-out_features // self.bw) * self.bw
        self.c = _LayerC(in_features, out_features, self.npad, 0, 0, None, None, None, None, None, None, None)
        self.slots: dict[int, tuple] = {}  # slot -> (at, bt, ranges, offs, rpad, fmt, scale)
        self._arrays: tuple = ()

    @staticmethod
    def fits(a: torch.Tensor) -> bool:
        return a.shape[0] <= MAX_RPAD

    def set_slot(self, slot: int, a: torch.Tensor, b: torch.Tensor, scale: float = 1.0) -> None:
        self.install(slot, self.pack(a, b, scale))

    def pack(self, a: torch.Tensor, b: torch.Tensor, scale: float = 1.0) -> tuple:
        """``a`` and ``b`` (both float32, bfloat16 or float16: ``FORMATS``) in the kernel's
        layout, kept in their format; the side path is ``(x @ a.T @ b.T) * scale``. Reads
        nothing that changes, so any thread may call it (the replica packs a new adapter
        off the engine thread)."""
        if a.dtype not in FORMATS or b.dtype != a.dtype:
            raise ValueError(f"LoRA A {a.dtype} and B {b.dtype}: both float32, bfloat16 or float16")
        rank, k, bw, dtype = a.shape[0], self.k, self.bw, a.dtype
        rpad = -(-rank // self.vl) * self.vl
        pairs = dtype == torch.bfloat16  # the reduction index interleaved in pairs (module doc)
        kpad = k + (k % 2 if pairs else 0)
        padded = torch.zeros(rpad, kpad, dtype=dtype)
        padded[:rank, :k] = a
        at = torch.cat([_paired(padded[c0 : c0 + bw].t(), pairs).reshape(-1) for c0 in range(0, rpad, bw)])
        bp = torch.zeros(self.npad, rank, dtype=dtype)
        bp[: self.n] = b
        panels = bp.view(-1, bw, rank)  # [blocks, BW, rank]
        nonzero = (panels != 0).any(dim=1).to(torch.int8)  # [blocks, rank]
        has = nonzero.any(dim=1)
        lo = torch.where(has, nonzero.argmax(dim=1), 0)
        hi = torch.where(has, rank - nonzero.flip(1).argmax(dim=1), 0)
        ranges = torch.stack([lo, hi], dim=1).to(torch.int32).contiguous()
        sizes = ((hi - lo + 1) // 2 * 2 if pairs else hi - lo) * bw
        offs = torch.cumsum(sizes, 0) - sizes
        pieces, bounds = [], list(zip(lo.tolist(), hi.tolist()))
        start = 0
        for i in range(1, len(bounds) + 1):  # runs of panels with the same ranks (a fused layer's parts)
            if i == len(bounds) or bounds[i] != bounds[start]:
                r0, r1 = bounds[start]
                run = panels[start:i, :, r0:r1].transpose(1, 2)  # [panels, ranks, BW]
                if pairs and (r1 - r0) % 2:
                    run = torch.cat([run, torch.zeros(i - start, 1, bw, dtype=dtype)], dim=1)
                if pairs:  # each panel's ranks in pairs, as _paired lays out one panel
                    run = run.reshape(i - start, -1, 2, bw).transpose(2, 3)
                pieces.append(run.reshape(-1))
                start = i
        bt = torch.cat(pieces + [torch.zeros(1, dtype=dtype)])  # one past the end: a layer whose B is all zero
        return at.contiguous(), bt.contiguous(), ranges, offs.contiguous(), rpad, FORMATS[dtype], float(scale)

    def install(self, slot: int, packed: tuple) -> None:
        """Makes ``packed`` (``pack``'s) ``slot``'s side path."""
        self.slots[slot] = packed
        self._publish()

    def clear_slot(self, slot: int) -> None:
        self.slots.pop(slot, None)
        self._publish()

    def _publish(self) -> None:
        """Rebuilds the per-slot pointer arrays the C struct points at."""
        num = max(self.slots, default=-1) + 1
        at, bt, ranges, offs = ((_P * max(num, 1))() for _ in range(4))
        rpad = (_L * max(num, 1))()
        fmt, scale = (ctypes.c_int * max(num, 1))(), (ctypes.c_float * max(num, 1))()
        for slot, (a, b, r, o, rp, f, sc) in self.slots.items():
            at[slot], bt[slot], ranges[slot], offs[slot] = a.data_ptr(), b.data_ptr(), r.data_ptr(), o.data_ptr()
            rpad[slot], fmt[slot], scale[slot] = rp, f, sc
        self._arrays = (at, bt, rpad, ranges, offs, fmt, scale)
        self.c.num_slots = num
        self.c.max_rpad = max((v[4] for v in self.slots.values()), default=0)
        self.c.at, self.c.bt = ctypes.addressof(at), ctypes.addressof(bt)
        self.c.rpad, self.c.ranges, self.c.offs = ctypes.addressof(rpad), ctypes.addressof(ranges), ctypes.addressof(offs)
        self.c.fmt, self.c.scale = ctypes.addressof(fmt), ctypes.addressof(scale)

    def add_to(self, rows: StepRows, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out[r] += (B_s A_s x[r]) * scale_s`` for each row of each slot in ``rows`` (in place)."""
        self.lib.lora_add_f32(ctypes.byref(self.c), ctypes.byref(rows.c), x.data_ptr(), x.stride(0),
                              out.data_ptr(), out.stride(0))
