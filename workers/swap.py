"""KV blocks between the device cache and the CPU swap cache (preemption by swap).

On CPU both caches are host memory: a copy is an index-select and an
index-put, done when asked. On a GPU the copies run on their own stream so
they overlap the step's compute, with the synchronization each direction
needs (the scheduler may hand a swapped-out block to another request in the
very step that swaps it out, and read a swapped-in block in the step that
swaps it in)::

    swap out (device -> host)
      compute stream: gather the blocks into a device staging tensor
                      (ordered after every earlier write to them, and before
                      any later one: the forward may reuse them at once)
      copy stream:    waits for the gather; copies the staging tensor into
                      pinned host memory; records `done`
      host:           scatters into the CPU cache only after `done`
                      (deferred: ``flush()``, at the latest before the next
                      swap or the next step reads the CPU cache)

    swap in (host -> device)
      host:           flush(); gathers the CPU blocks into pinned memory
      copy stream:    copies them to a device staging tensor; records `done`
      compute stream: waits for `done`, then scatters into the device cache
                      (so the forward that reads them comes after)

The GPU API is reached through ``CudaApi`` so that a unit test can check this
order with a fake one (``tests/unit/test_swap.py``); a GPU test checks the
data (``tests/gpu``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch


class CudaApi:
    """The few stream and event calls the swapper makes (real CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def on_stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def record(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def pinned(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)


class BlockSwapper:
    """Copies block ids between ``device_caches`` and ``cpu_caches`` (one
    tensor per layer, blocks on dimension 1)."""

    def __init__(self, device_caches: list[torch.Tensor], cpu_caches: list[torch.Tensor], device: torch.device,
                 cuda: Optional[CudaApi] = None) -> None:
        self.device_caches = device_caches
        self.cpu_caches = cpu_caches
        self.device = device
        self.cuda = cuda if cuda is not None else (CudaApi(device) if device.type == "cuda" else None)
        self._stream = self.cuda.new_stream() if self.cuda is not None and cpu_caches else None
        # Device -> host copies whose host scatter waits for them: (done, host staging per layer, cpu block ids).
        self._pending: list[tuple[Any, list[torch.Tensor], torch.Tensor]] = []

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device block ``a`` -> CPU block ``b`` for each pair."""
        src = torch.tensor([a for a, _ in pairs], dtype=torch.long)
        dst = torch.tensor([b for _, b in pairs], dtype=torch.long)
        if self.cuda is None:
            for dev, host in zip(self.device_caches, self.cpu_caches):
                host[:, dst] = dev[:, src.to(dev.device)].to(host.device)
            return
        self.flush()  # earlier copies land first: the same CPU block may be written twice
        cuda, compute = self.cuda, self.cuda.current_stream()
        src_dev = src.to(self.device, non_blocking=True)
        staged = [dev[:, src_dev] for dev in self.device_caches]  # on the compute stream, in order
        gathered = cuda.record(compute)
        cuda.wait(self._stream, gathered)
        hosts = []
        with cuda.on_stream(self._stream):
            for tensor in staged:
                host = cuda.pinned(tensor)
                host.copy_(tensor, non_blocking=True)
                cuda.keep_alive(tensor, self._stream)  # the compute stream may free it before the copy ran
                hosts.append(host)
        self._pending.append((cuda.record(self._stream), hosts, dst))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """CPU block ``a`` -> device block ``b`` for each pair."""
        src = torch.tensor([a for a, _ in pairs], dtype=torch.long)
        dst = torch.tensor([b for _, b in pairs], dtype=torch.long)
        if self.cuda is None:
            for host, dev in zip(self.cpu_caches, self.device_caches):
                dev[:, dst.to(dev.device)] = host[:, src].to(dev.device)
            return
        self.flush()  # the CPU blocks read here may still be on their way from the device
        cuda, compute = self.cuda, self.cuda.current_stream()
        staged = []
        with cuda.on_stream(self._stream):
            for host in self.cpu_caches:
                pinned = cuda.pinned(host[:, src])
                pinned.copy_(host[:, src])
                staged.append(pinned.to(self.device, non_blocking=True))
        arrived = cuda.record(self._stream)
        cuda.wait(compute, arrived)
        dst_dev = dst.to(self.device, non_blocking=True)
        for tensor, dev in zip(staged, self.device_caches):
            cuda.keep_alive(tensor, compute)  # allocated on the copy stream, read on the compute stream
            dev[:, dst_dev] = tensor

    def flush(self) -> None:
        """Finishes the deferred host writes of earlier swap-outs, oldest first."""
        while self._pending:
            done, hosts, dst = self._pending.pop(0)
            self.cuda.synchronize(done)
            for host, cpu in zip(hosts, self.cpu_caches):
                cpu[:, dst] = host
