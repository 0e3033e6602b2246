"""The native LoRA kernel (``workers/model/lora_kernels.py``): each adapter's delta
on its own rows, equal to torch's ``x @ A.T @ B.T`` (allclose), rows of no
adapter untouched, and a row's result bit-identical whatever its batch-mates
(alone, among rows of its adapter in blocks of four and a tail, among other
adapters' rows)."""

from __future__ import annotations

import pytest
import torch

from workers.model import lora_kernels as kernels
from workers.lora.layers import LoRABatch, LoRALayer

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="the native LoRA kernel does not build here")

K, N = 72, 100  # N not a multiple of the block width; K not a multiple of the vector width


def fused_delta(ranks: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused layer's side path: A stacked, B block-diagonal over parts of N (as ``adapter.py`` builds it)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(sum(ranks), K, generator=gen)
    b = torch.zeros(N, sum(ranks))
    bounds = torch.linspace(0, N, len(ranks) + 1).long().tolist()
    col = 0
    for part, rank in enumerate(ranks):
        b[bounds[part] : bounds[part + 1], col : col + rank] = torch.randn(bounds[part + 1] - bounds[part], rank,
                                                                          generator=gen)
        col += rank
    return a, b


ADAPTERS = {0: fused_delta([8, 8, 8], 1), 2: fused_delta([5], 2), 3: fused_delta([16, 16], 3), 4: fused_delta([8], 4)}


def make_layer(native: bool) -> tuple[LoRABatch, LoRALayer]:
    batch = LoRABatch()
    layer = LoRALayer(batch, native)
    for slot, (a, b) in ADAPTERS.items():
        layer.set_slot(slot, a, b)
    return batch, layer


def run(layer: LoRALayer, batch: LoRABatch, x: torch.Tensor, out: torch.Tensor, slots: list[int]) -> torch.Tensor:
    batch.set([(s, 1) for s in slots], len(slots), torch.device("cpu"))
    return layer.add_to(x, out.clone())


def reference(x: torch.Tensor, out: torch.Tensor, slots: list[int]) -> torch.Tensor:
    expected = out.double().clone()
    for row, slot in enumerate(slots):
        if slot in ADAPTERS:
            a, b = ADAPTERS[slot]
            expected[row] += x[row].double() @ a.double().T @ b.double().T
    return expected


# 5: loaded elsewhere, this layer has no side path for it. The kernel splits blocks of rows over the
# threads where a group has many rows, and whole groups where every group has a few (SMALL_GROUPS).
SLOTS = [0, 2, 0, -1, 3, 0, 0, 5, 2, 0, 3, 0, -1]
SMALL_GROUPS = [0, 2, 3, 4, 0, -1, 4, 2, 5]


@pytest.mark.parametrize("slots", [SLOTS, SMALL_GROUPS])
def test_grouped_kernel_matches_torch_and_leaves_base_rows(slots):
    batch, layer = make_layer(native=True)
    assert layer.grouped is not None and not layer.slots
    gen = torch.Generator().manual_seed(0)
    x, out = torch.randn(len(slots), K, generator=gen), torch.randn(len(slots), N, generator=gen)
    got = run(layer, batch, x, out, slots)
    torch.testing.assert_close(got.double(), reference(x, out, slots), rtol=1e-5, atol=1e-4)
    for row, slot in enumerate(slots):
        if slot not in ADAPTERS:
            assert torch.equal(got[row], out[row])


@pytest.mark.parametrize("slots", [SLOTS, SMALL_GROUPS])
def test_grouped_kernel_is_batch_invariant(slots):
    batch, layer = make_layer(native=True)
    gen = torch.Generator().manual_seed(1)
    x, out = torch.randn(len(slots), K, generator=gen), torch.randn(len(slots), N, generator=gen)
    full = run(layer, batch, x, out, slots)
    for row, slot in enumerate(slots):
        alone = run(layer, batch, x[row : row + 1], out[row : row + 1], [slot])
        assert torch.equal(alone[0], full[row]), row
        # among 6 rows of its own adapter (a block of four and a tail), at every position
        for pos in range(6):
            mates = torch.randn(6, K, generator=gen)
            mates[pos] = x[row]
            bases = torch.randn(6, N, generator=gen)
            bases[pos] = out[row]
            assert torch.equal(run(layer, batch, mates, bases, [slot] * 6)[pos], full[row]), (row, pos)


@pytest.mark.parametrize("slots", [SLOTS, SMALL_GROUPS])
def test_grouped_kernel_equals_per_adapter_gemm_path(slots):
    """The grouped kernel and the per-adapter GEMM path compute the same FMA chains: same bits."""
    from workers.model import gemm

    if gemm.load() is None:
        pytest.skip("the native GEMM does not build here")
    batch, layer = make_layer(native=True)
    gen = torch.Generator().manual_seed(2)
    x, out = torch.randn(len(slots), K, generator=gen), torch.randn(len(slots), N, generator=gen)
    got = run(layer, batch, x, out, slots)
    layer._lib = None  # the per-adapter path, the native GEMM
    layer.grouped = None
    for slot, (a, b) in ADAPTERS.items():
        layer.set_slot(slot, a, b)
    assert layer.grouped is None and set(layer.slots) == set(ADAPTERS)
    assert torch.equal(run(layer, batch, x, out, slots), got)


def test_cleared_slot_adds_nothing():
    batch, layer = make_layer(native=True)
    layer.clear_slot(0)
    x, out = torch.randn(3, K), torch.randn(3, N)
    assert torch.equal(run(layer, batch, x, out, [0, 0, 0]), out)


def attach_side_paths(model, num_slots: int, seed: int) -> LoRABatch:
    """Random side paths (rank 8) on every targetable layer of ``model`` in ``num_slots`` slots, as the
    engine's adapter slots attach them."""
    from workers.lora.adapter import TARGETS
    from workers.model.linear import Linear

    batch = LoRABatch()
    gen = torch.Generator().manual_seed(seed)
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name.rsplit(".", 1)[-1] in TARGETS:
            module.lora = LoRALayer(batch, native=True)
            for slot in range(num_slots):
                a = torch.randn(8, module.in_features, generator=gen) * 0.1
                b = torch.randn(module.out_features, 8, generator=gen) * 0.1
                module.lora.set_slot(slot, a, b)
    return batch


def test_native_decoder_runs_the_side_paths_bitwise(tmp_path):
    """The native decoder (its per-layer loop with prefill chunks, its one-call step for decodes) adds the
    side paths where the module path's ``Linear.forward`` does: the same logits, bit for bit, and not the
    base model's."""
    import random

    from tests.factories import make_hf_config, make_hf_model
    from tests.models.conftest import PagedDriver, save_hf_model
    from workers.model.attention.torch_backend import TorchAttentionBackend
    from workers.model.loader import load_model

    folder = save_hf_model(make_hf_model(make_hf_config("llama")), tmp_path)
    model, _ = load_model(folder, "float32", "cpu", TorchAttentionBackend())
    fast = model.native_decoder
    if fast is None or fast._driver is None:
        pytest.skip("a native kernel did not build here")
    batch = attach_side_paths(model, num_slots=3, seed=0)
    adapter = {"r0": 0, "r1": -1, "r2": 2, "r3": 0}  # r1: the base model
    rng = random.Random(3)
    prompts = {rid: [rng.randrange(3, 500) for _ in range(n)] for rid, n in zip(adapter, [5, 13, 1, 22])}
    drivers = [PagedDriver(model, block_size=4) for _ in range(3)]
    steps = [
        {"r0": prompts["r0"], "r1": prompts["r1"][:6]},
        {"r0": [7], "r1": prompts["r1"][6:], "r2": prompts["r2"]},
        {"r0": [8], "r1": [9], "r2": [10]},  # decode only: the one-call step
        {"r0": [11], "r1": [12], "r2": [13], "r3": prompts["r3"]},
        {"r0": [14], "r1": [15], "r2": [16], "r3": [17]},
    ]
    for chunks in steps:
        order = sorted(chunks, key=lambda rid: len(chunks[rid]) != 1)  # PagedDriver's row order
        rows = [(adapter[rid], len(chunks[rid])) for rid in order]
        outs = []
        for decoder, driver, lora in ((fast, drivers[0], True), (None, drivers[1], True), (None, drivers[2], False)):
            model.native_decoder = decoder
            batch.set(rows if lora else [(-1, n) for _, n in rows], sum(n for _, n in rows), torch.device("cpu"))
            outs.append(driver.step(chunks))
        for rid in chunks:
            assert torch.equal(outs[0][rid], outs[1][rid]), rid
            assert torch.equal(outs[0][rid], outs[2][rid]) == (adapter[rid] < 0), rid
    model.native_decoder = fast


@pytest.mark.parametrize("arch", ["native", "haswell"])
def test_each_instruction_set_matches_torch_and_is_batch_invariant(arch):
    """The AVX2 path (``-march=haswell``) as well as this machine's: a NativeLayer built on each."""
    from workers.model import native

    lib = kernels.load(native.FLAGS if arch == "native" else (*native.FLAGS, "-march=haswell"))
    if lib is None:
        pytest.skip(f"the {arch} build failed here")
    layer = kernels.NativeLayer(lib, K, N)
    for slot, (a, b) in ADAPTERS.items():
        layer.set_slot(slot, a, b)
    batch = LoRABatch()
    gen = torch.Generator().manual_seed(4)
    for slots in (SLOTS, SMALL_GROUPS):
        x, out = torch.randn(len(slots), K, generator=gen), torch.randn(len(slots), N, generator=gen)
        batch.set([(s, 1) for s in slots], len(slots), torch.device("cpu"))
        got = out.clone()
        layer.add_to(batch.rows, x, got)
        torch.testing.assert_close(got.double(), reference(x, out, slots), rtol=1e-5, atol=1e-4)
        for row, slot in enumerate(slots):
            batch.set([(slot, 1)], 1, torch.device("cpu"))
            alone = out[row : row + 1].clone()
            layer.add_to(batch.rows, x[row : row + 1], alone)
            assert torch.equal(alone[0], got[row]), (arch, row)


@pytest.mark.parametrize("arch", ["native", "haswell"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_side_paths_are_the_widened_values_exactly(arch, dtype):
    """An adapter saved in bf16 / fp16 stays 16-bit in the kernel's panels (half the bytes) and computes the
    same bits as its float32 widening, on each instruction set, through the grouped kernel and the per-adapter
    path alike; the scaling multiplies the expand's chain."""
    from workers.model import gemm, native

    lib = kernels.load(native.FLAGS if arch == "native" else (*native.FLAGS, "-march=haswell"))
    if lib is None:
        pytest.skip(f"the {arch} build failed here")
    half = {slot: (a.to(dtype), b.to(dtype)) for slot, (a, b) in ADAPTERS.items()}
    layers = {}
    for name, fmt, exact_lib in (("half", dtype, lib), ("widened", torch.float32, lib), ("pair", dtype, None)):
        batch = LoRABatch()
        layer = LoRALayer(batch, native=True)
        layer._lib = exact_lib
        for slot, (a, b) in half.items():
            layer.set_slot(slot, a.to(fmt), b.to(fmt), scale=0.75)
        layers[name] = (batch, layer)
    half_layer = layers["half"][1]
    assert half_layer.grouped is not None and {p[0].dtype for p in half_layer.grouped.slots.values()} == {dtype}
    weights = {name: sum(t.numel() * t.element_size() for p in layer.grouped.slots.values() for t in p[:2])
               for name, (_, layer) in layers.items() if name != "pair"}
    if dtype == torch.bfloat16:  # half the bytes but for the pad of an odd rank's last pair (rank 5 here)
        assert weights["widened"] < weights["half"] * 2 <= weights["widened"] * 1.05
    else:
        assert weights["half"] * 2 == weights["widened"]
    gen = torch.Generator().manual_seed(5)
    for slots in (SLOTS, SMALL_GROUPS):
        x, out = torch.randn(len(slots), K, generator=gen), torch.randn(len(slots), N, generator=gen)
        got = run(half_layer, layers["half"][0], x, out, slots)
        expected = out.double().clone()
        for row, slot in enumerate(slots):
            if slot in half:
                a, b = half[slot]
                expected[row] += (x[row].double() @ a.double().T @ b.double().T) * 0.75
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
        assert torch.equal(run(layers["widened"][1], layers["widened"][0], x, out, slots), got)
        if gemm.load() is not None and arch == "native":
            assert torch.equal(run(layers["pair"][1], layers["pair"][0], x, out, slots), got)
        for row, slot in enumerate(slots):
            assert torch.equal(run(half_layer, layers["half"][0], x[row : row + 1], out[row : row + 1], [slot])[0],
                               got[row]), (row, slot)


def test_co_located_panels_compute_the_same_bits():
    """An adapter's panels moved into one buffer (on huge pages from 2 MiB, so a step streams it as one
    run) hold the same values, so the kernel adds the same bits."""
    from workers.lora.layers import co_locate

    batch, layer = make_layer(native=True)
    gen = torch.Generator().manual_seed(3)
    x, out = torch.randn(len(SLOTS), K, generator=gen), torch.randn(len(SLOTS), N, generator=gen)
    scattered = run(layer, batch, x, out, SLOTS)
    moved = co_locate({slot: layer.prepare(a, b) for slot, (a, b) in ADAPTERS.items()})
    for slot, prepared in moved.items():
        layer.install(slot, prepared)
    at, bt = moved[0][1][2][:2]
    assert at.data_ptr() % kernels.ALIGN == 0 and bt.data_ptr() >= at.data_ptr() + at.numel() * 4
    assert torch.equal(run(layer, batch, x, out, SLOTS), scattered)


def test_arena_is_zeroed_and_huge_page_aligned():
    import mmap

    big = kernels.arena(3 * kernels.HUGE_PAGE + 5)
    assert big.numel() == 3 * kernels.HUGE_PAGE + 5 and not big.any()
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert big.data_ptr() % kernels.HUGE_PAGE == 0
    assert kernels.arena(100).numel() == 100


@pytest.mark.parametrize("k", [K, K - 1])  # bfloat16 panels pair up the reduction index: an odd k pads one
@pytest.mark.parametrize("slots", [SLOTS, SMALL_GROUPS])
def test_bfloat16_panels_compute_the_float32_bits(slots, k):
    """A bfloat16 adapter (its own panel layout, widened in registers) adds exactly what the float32 path
    adds on the same values, odd ranks (5) and odd k included."""
    layers = {}
    for dtype in (torch.bfloat16, torch.float32):
        batch, layer = LoRABatch(), None
        layer = LoRALayer(batch, native=True)
        for slot, (a, b) in ADAPTERS.items():
            layer.set_slot(slot, a[:, :k].bfloat16().to(dtype), b.bfloat16().to(dtype), 0.75)
        layers[dtype] = (batch, layer)
    gen = torch.Generator().manual_seed(4)
    x, out = torch.randn(len(slots), k, generator=gen), torch.randn(len(slots), N, generator=gen)
    got = {dtype: run(layer, batch, x, out, slots) for dtype, (batch, layer) in layers.items()}
    assert torch.equal(got[torch.bfloat16], got[torch.float32])
    assert not torch.equal(got[torch.float32], out)
