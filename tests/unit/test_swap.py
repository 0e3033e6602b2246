"""The swapper's stream and event order, with a fake CUDA API on CPU tensors
(the data path of a real GPU is in ``tests/gpu``)."""

from __future__ import annotations

import contextlib

import torch

from workers.swap import BlockSwapper


class FakeCuda:
    """Logs every call; events are names, streams are 'compute' and 'copy'."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.stream = "compute"
        self.on_sync = None  # called at synchronize(event), before it returns
        self.on_wait = None  # called at wait(stream, event)
        self._events = 0

    def new_stream(self):
        return "copy"

    def current_stream(self):
        return "compute"

    @contextlib.contextmanager
    def on_stream(self, stream):
        self.log.append(f"enter {stream}")
        previous, self.stream = self.stream, stream
        try:
            yield
        finally:
            self.stream = previous
            self.log.append(f"leave {stream}")

    def record(self, stream):
        self._events += 1
        name = f"e{self._events}"
        self.log.append(f"record {name} on {stream}")
        return name

    def wait(self, stream, event):
        self.log.append(f"{stream} waits {event}")
        if self.on_wait:
            self.on_wait()

    def synchronize(self, event):
        self.log.append(f"host waits {event}")
        if self.on_sync:
            self.on_sync()

    def pinned(self, like):
        return torch.empty(like.shape, dtype=like.dtype)

    def keep_alive(self, tensor, stream):
        self.log.append(f"keep for {stream}")


def _caches(num_blocks: int, layers: int = 2, fill: float = 0.0) -> list[torch.Tensor]:
    return [torch.full((2, num_blocks, 4, 1, 8), fill) for _ in range(layers)]


def _numbered(caches: list[torch.Tensor]) -> None:
    for layer, cache in enumerate(caches):
        for block in range(cache.shape[1]):
            cache[:, block] = 100 * layer + block


def test_swap_out_is_written_to_the_host_only_after_the_copy_is_done():
    device, host = _caches(6), _caches(4, fill=-1.0)
    _numbered(device)
    cuda = FakeCuda()
    swapper = BlockSwapper(device, host, torch.device("cpu"), cuda=cuda)
    swapper.swap_out([(2, 0), (5, 3)])
    log = cuda.log
    # The copy stream waits for the gather on the compute stream, copies, then records `done`.
    gathered = log.index("record e1 on compute")
    assert log.index("copy waits e1") > gathered
    assert log.index("enter copy") > log.index("copy waits e1")
    assert "keep for copy" in log, "the staging tensor must outlive the compute stream's use"
    assert log[-1] == "record e2 on copy" and log[-2] == "leave copy"
    # Deferred: nothing on the host yet, even if the device blocks are reused at once.
    assert swapper.num_pending == 1 and (host[0] == -1).all()
    for cache in device:
        cache[:, [2, 5]] = 7.0  # the forward writes a new request's KV into the freed blocks
    seen_at_sync = []
    cuda.on_sync = lambda: seen_at_sync.append(bool((host[0] == -1).all()))
    swapper.flush()
    assert seen_at_sync == [True], "the host is written after the wait, not before"
    for layer in range(2):
        assert (host[layer][:, 0] == 100 * layer + 2).all() and (host[layer][:, 3] == 100 * layer + 5).all()
        assert (host[layer][:, 1] == -1).all()
    assert swapper.num_pending == 0


def test_swap_in_waits_for_earlier_swap_outs_and_the_forward_waits_for_it():
    device, host = _caches(6), _caches(4, fill=-1.0)
    _numbered(device)
    cuda = FakeCuda()
    swapper = BlockSwapper(device, host, torch.device("cpu"), cuda=cuda)
    swapper.swap_out([(1, 2)])  # still pending when the swap-in comes
    cuda.log.clear()
    seen_at_wait = []
    cuda.on_wait = lambda: seen_at_wait.append(bool((device[1][:, 4] == 104).all()))
    swapper.swap_in([(2, 4)])  # the block just swapped out, into device block 4
    log = cuda.log
    assert log[0] == "host waits e2", "host blocks are read only after their swap-out landed"
    arrived = next(line for line in log if line.startswith("record") and line.endswith("on copy"))
    assert log.index("compute waits " + arrived.split()[1]) > log.index(arrived)
    assert seen_at_wait == [True], "the device blocks are written after the compute stream waits"
    for layer in range(2):
        assert (device[layer][:, 4] == 100 * layer + 1).all()


def test_a_cpu_block_written_twice_keeps_the_later_copy():
    device, host = _caches(4), _caches(2, fill=-1.0)
    _numbered(device)
    swapper = BlockSwapper(device, host, torch.device("cpu"), cuda=FakeCuda())
    swapper.swap_out([(1, 0)])
    swapper.swap_out([(3, 0)])  # the scheduler freed CPU block 0 and gave it out again
    swapper.flush()
    assert (host[0][:, 0] == 3).all()


def test_on_cpu_copies_happen_at_once_without_streams():
    device, host = _caches(3), _caches(2, fill=-1.0)
    _numbered(device)
    swapper = BlockSwapper(device, host, torch.device("cpu"))
    assert swapper.cuda is None
    swapper.swap_out([(2, 1)])
    assert swapper.num_pending == 0 and (host[1][:, 1] == 102).all()
    swapper.swap_in([(1, 0)])
    assert (device[1][:, 0] == 102).all()
