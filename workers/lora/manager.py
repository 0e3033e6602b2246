"""The engine's adapters: loaded on first use (or at start), kept in an LRU
of ``max_cpu_loras``, each in a slot of every layer it targets.

A request's adapter is resolved when the engine queues it
(:meth:`LoRAManager.acquire`): loaded if it is not, and bound to the slot
the runner names in each step. An adapter any unfinished request uses is
never evicted; when every loaded adapter is in use the cache holds one more
until requests finish (the limit on adapters *in a step*, ``max_loras``, is
the scheduler's, ``workers/engine/lora_slots.py``).

Adapters are told apart by ``(name, path, lora_int_id)``; the prefix cache by content
(``cluster.shared.hashing.lora_fingerprint``): two names for the same weights share blocks, and
a name loaded again with other weights never reads the old ones.

The manager keeps the bookkeeping (the LRU, slots, content hashes) and no
tensor: its ``slots`` (``side_paths.py``) hold the side paths, in this
process's layers or, with tensor parallelism, in every rank's, each the
same adapters in the same slots.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional, Union

from cluster.shared.config import LoRAConfig
from cluster.shared.types import LoRARequest
from workers.lora.adapter import LoRAAdapter
from workers.lora.load_cost import LoadCost
from workers.lora.side_paths import AdapterSlots, RankAdapterSlots

logger = logging.getLogger(__name__)

_READ_AHEAD = 8  # adapters read ahead and not yet loaded, kept at most
REGISTRY_GRACE_S = 10.0  # a run-time adapter younger than this is kept though unregistered (drop_unregistered)


@dataclass(frozen=True)
class ActiveLoRA:
    """A request's adapter as the scheduler and runner see it."""

    slot: int
    name: str
    content_hash: str


class LoRAManager:
    """Loads adapters into the model's layers and hands out their slots.

    Args:
        slots: Where the side paths live: this process's layers
            (``AdapterSlots``) or every tensor-parallel rank's
            (``RankAdapterSlots``).
        config: ``max_cpu_loras``, ``lora_modules``.
    """

    def __init__(self, slots: Union[AdapterSlots, RankAdapterSlots], config: LoRAConfig) -> None:
        self.slots = slots
        self.config = config
        self.batch = getattr(slots, "batch", None)  # the runner's, in one process (the ranks hold their own)
        # (name, path, lora_int_id) -> (adapter, slot), least recently used first. The id tells a name
        # loaded again at run time (router/lora_registry.py: a new generation) from the one before.
        self._loaded: OrderedDict[tuple[str, str, int], tuple[LoRAAdapter, int]] = OrderedDict()
        self.published: tuple[tuple[str, str], ...] = ()  # (name, content hash), replaced whole: any thread reads
        self._read_ahead: dict[tuple[str, str, int], LoRAAdapter] = {}  # prefetch() -> load(), any thread
        self._read_lock = threading.Lock()
        self._loaded_at: dict[tuple[str, str, int], float] = {}  # time.monotonic() of each load
        self.num_loads = 0
        self.num_evictions = 0
        self.last_load_s = 0.0
        self.cost = LoadCost()  # measured load time and prefill rate: the routers' price of a load here
        for name, path in config.modules.items():
            self.load(LoRARequest(name, 0, path))

    @property
    def capacity(self) -> int:
        return self.config.cpu_capacity

    def names(self) -> list[str]:
        """Loaded adapters' names, most recently used last."""
        return [key[0] for key in self._loaded]

    def path_of(self, name: str) -> Optional[str]:
        """The path of a loaded adapter called ``name`` (the most recent), or None."""
        paths = [path for (n, path, _) in list(self._loaded) if n == name]  # list(): one step, any thread
        return paths[-1] if paths else None

    def load(self, request: LoRARequest, in_use: Iterable[int] = ()) -> tuple[LoRAAdapter, int]:
        """The adapter of ``request`` and its slot, loaded if it is not
        (evicting least recently used adapters no request uses).

        Raises:
            ValueError: The adapter cannot be loaded (``adapter.load_adapter``).
        """
        path = self._path(request)
        if not path:
            known = ", ".join(self.names()) or "none"
            raise ValueError(f"LoRA adapter {request.lora_name!r} is not loaded and has no path "
                             f"(loaded: {known})")
        key = (request.lora_name, path, request.lora_int_id)
        if key in self._loaded:
            self._loaded.move_to_end(key)
            return self._loaded[key]
        started = time.perf_counter()
        with self._read_lock:
            read = self._read_ahead.pop(key, None)
        if read is not None:  # read off this thread (prefetch): only the install is left
            adapter = self.slots.stage_read(read)
        else:
            adapter = self.slots.stage(request.lora_name, path)  # refused: nothing changed
        victims = self._victims(set(in_use), room_for=1)
        taken = {slot for k, (_, slot) in self._loaded.items() if k not in victims}
        slot = next(i for i in range(len(taken) + 1) if i not in taken)
        self.slots.commit(slot, [self._loaded[k][1] for k in victims])
        for victim in victims:
            self._forget(victim)
            self.num_evictions += 1
        self._loaded[key] = (adapter, slot)
        self._loaded_at[key] = time.monotonic()
        self._publish()
        self.num_loads += 1
        self.last_load_s = time.perf_counter() - started
        self.cost.observe_load(self.last_load_s)
        logger.info("LoRA adapter %s loaded from %s in %.0f ms: rank %d, slot %d", adapter.name, path,
                    self.last_load_s * 1e3, adapter.rank, slot)
        return adapter, slot

    def prefetch(self, request: LoRARequest) -> None:
        """Reads an adapter that is not loaded, on the caller's thread (not the
        engine's), so that ``load`` only installs it: a new adapter stalls the
        running streams for its install, not its read. Refused adapters raise
        here (ValueError) and again at ``load``. No-op with tensor parallelism
        (the ranks read) or when it is loaded; at most a few are kept read."""
        read = getattr(self.slots, "read", None)
        path = self._path(request)
        key = (request.lora_name, path, request.lora_int_id)
        if read is None or not path or key in self._loaded or key in self._read_ahead:
            return
        adapter = read(request.lora_name, path)
        with self._read_lock:
            while len(self._read_ahead) >= _READ_AHEAD:  # unclaimed ones (requests that never came) go first
                self._read_ahead.pop(next(iter(self._read_ahead)))
            self._read_ahead[key] = adapter

    def content_hash(self, request: LoRARequest) -> Optional[str]:
        """The content hash of ``request``'s adapter where it is loaded or read
        ahead here (any thread), else None: what its KV blocks hash on."""
        key = (request.lora_name, self._path(request), request.lora_int_id)
        held = self._loaded.get(key)
        if held is not None:
            return held[0].content_hash
        with self._read_lock:
            read = self._read_ahead.get(key)
        return read.content_hash if read is not None else None

    def _path(self, request: LoRARequest) -> str:
        """Where the request's adapter is read from ("" when nothing says)."""
        name = request.lora_name
        return (request.lora_path or self.path_of(name) or self.config.modules.get(name)
                or self.config.dynamic_path(name) or "")

    def acquire(self, request: LoRARequest, in_use: Iterable[int]) -> ActiveLoRA:
        """The request's adapter, loaded, as the scheduler and runner see it."""
        adapter, slot = self.load(request, in_use)
        return ActiveLoRA(slot, adapter.name, adapter.content_hash)

    def unload(self, name: str, in_use: Iterable[int]) -> bool:
        """Drops every loaded adapter called ``name`` (False: none was loaded).

        Raises:
            ValueError: A request still uses it.
        """
        keys = [key for key in self._loaded if key[0] == name]
        busy = set(in_use)
        if any(self._loaded[key][1] in busy for key in keys):
            raise ValueError(f"LoRA adapter {name!r} is in use by running requests; unload it after they finish")
        self.slots.drop([self._loaded[key][1] for key in keys])
        for key in keys:
            self._forget(key)
        with self._read_lock:  # read ahead and not installed yet: their tensors go too
            for key in [key for key in self._read_ahead if key[0] == name]:
                del self._read_ahead[key]
        return bool(keys)

    def has_runtime_adapters(self) -> bool:
        """Whether an adapter a router loaded at run time is loaded (any thread)."""
        return any(key[2] > 0 for key in list(self._loaded))

    def drop_unregistered(self, registered: dict[str, int], in_use: Iterable[int],
                          min_age_s: float = REGISTRY_GRACE_S) -> list[str]:
        """Unloads the run-time adapters the routers' registry no longer lists.

        A run-time adapter (``POST /v1/load_lora_adapter``) reaches the replica
        with its registry generation as ``lora_int_id`` (> 0; ``lora_modules``
        and folder adapters have 0, and stay). One whose name the registry
        (``registered``: name -> generation) lists at another generation, or not
        at all, was unloaded or replaced: its weights are dropped now rather than
        when the LRU needs the room, unless a request still uses it or it was
        loaded under ``min_age_s`` ago (a load is checked on a replica before it is
        registered). Returns the names dropped.
        """
        now, busy = time.monotonic(), set(in_use)
        stale = [key for key, (_, slot) in self._loaded.items()
                 if key[2] > 0 and registered.get(key[0]) != key[2] and slot not in busy
                 and now - self._loaded_at.get(key, now) >= min_age_s]
        self.slots.drop([self._loaded[key][1] for key in stale])
        for key in stale:
            self._forget(key)
        return [key[0] for key in stale]

    def num_bytes(self) -> Optional[int]:
        """Bytes of the installed side paths in this process (None with tensor
        parallelism: each rank holds its shard); an unload or eviction frees its adapter's."""
        count = getattr(self.slots, "num_bytes", None)
        return count() if count is not None else None

    @property
    def over_capacity(self) -> bool:
        """More adapters loaded than ``max_cpu_loras`` (all were in use when the last one came)."""
        return len(self._loaded) > self.capacity

    def trim(self, in_use: Iterable[int]) -> None:
        """Evicts least recently used adapters no request uses, down to the capacity."""
        victims = self._victims(set(in_use), room_for=0)
        self.slots.drop([self._loaded[key][1] for key in victims])
        for key in victims:
            self._forget(key)
            self.num_evictions += 1

    def _publish(self) -> None:
        self.published = tuple((a.name, a.content_hash) for a, _ in self._loaded.values())

    def _victims(self, in_use: set[int], room_for: int) -> list[tuple[str, str, int]]:
        """Least recently used adapters no request uses, enough to leave ``room_for`` below the capacity."""
        victims: list[tuple[str, str, int]] = []
        for key, (_, slot) in self._loaded.items():
            if len(self._loaded) - len(victims) + room_for <= self.capacity:
                break
            if slot not in in_use:
                victims.append(key)
        return victims

    def _forget(self, key: tuple[str, str, int]) -> None:
        _, slot = self._loaded.pop(key)
        self._loaded_at.pop(key, None)
        self._publish()
        logger.info("LoRA adapter %s (%s) unloaded from slot %d", key[0], key[1], slot)
