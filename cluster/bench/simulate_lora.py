"""LoRA adapters in ``prefixserve simulate`` (``--adapters N``).

Trace: each request runs one of ``--adapters`` adapters, drawn Zipf with
``--adapter-zipf`` (a few hot, many cold) from its own seeded RNG (the
prompts stay those of the run without adapters); a chat session keeps its
first turn's adapter. Its blocks are hashed with the adapter's content
hash, as replicas do (``cluster.shared.hashing.lora_fingerprint``), so a
prefix is shared only between requests of one adapter.

Replicas: an LRU of ``--max-cpu-loras`` loaded adapters each. A request
whose adapter is not loaded pays ``--adapter-load-ms`` before its prefill,
in the replica's serial prefill queue (the load delays the requests behind
it too), and a load into a full LRU evicts the least recently used one
(the real manager spares adapters a running request uses; at these loads
one is nearly always idle). Replicas publish their adapters with their
stats (``lora_adapters``, ``max_cpu_loras``), so routers see them as old
as the rest of the figures.

Reported per run: adapter loads and evictions per minute (the fleet's,
per simulated minute) and the share of requests whose adapter was loaded.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import random
from collections import OrderedDict
from typing import Any, Callable

from cluster.shared.hashing import lora_fingerprint, root_hash

logger = logging.getLogger(__name__)

MODEL_FINGERPRINT = "simulated-model"  # the root the trace hashes base-model prompts with


def add_adapter_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--adapters", type=int, default=0, help="LoRA adapters in the trace (0: base model only)")
    parser.add_argument("--adapter-zipf", type=float, default=1.1, help="popularity exponent of the adapters")
    parser.add_argument("--max-cpu-loras", type=int, default=8, help="adapters one replica keeps loaded")
    parser.add_argument("--adapter-load-ms", type=float, default=20.0, help="time to load one adapter")


def check_adapter_args(args: argparse.Namespace) -> bool:
    """Whether the adapter options are valid (logs what to change when not)."""
    if args.adapters < 0 or (args.adapters and (args.max_cpu_loras < 1 or args.adapter_load_ms < 0
                                                or args.adapter_zipf <= 0)):
        logger.error("bad arguments: --adapters must be >= 0, --max-cpu-loras >= 1, --adapter-load-ms >= 0, "
                     "--adapter-zipf > 0")
        return False
    return True


def policy_defaults(args: argparse.Namespace, policy: str) -> dict[str, Any]:
    """Parameters the simulator gives a policy unless ``--policy-params`` says otherwise."""
    if policy in ("power_of_two", "random"):
        return {"seed": args.seed}
    if policy == "prefix_cost" and getattr(args, "adapters", 0):
        # A load in the cost model's unit: prefill tokens of the simulated replicas.
        return {"adapter_load_tokens": args.adapter_load_ms / 1000 * args.prefill_tokens_per_s}
    return {}


class AdapterDraw:
    """The trace's adapters: Zipf draws from a seeded RNG of their own, and their hash roots."""

    def __init__(self, args: argparse.Namespace,
                 sampler: Callable[[int, float, random.Random], Callable[[], int]]) -> None:
        self._draw = sampler(args.adapters, args.adapter_zipf, random.Random(args.seed + 7))
        self._roots: dict[str, bytes] = {}

    def draw(self) -> str:
        return f"adapter-{self._draw():04d}"

    def root(self, adapter: str) -> bytes:
        """The block-chain root of the adapter's requests (what a replica hashes them with)."""
        root = self._roots.get(adapter)
        if root is None:
            content = hashlib.blake2b(adapter.encode(), digest_size=8).hexdigest()
            root = self._roots[adapter] = root_hash(lora_fingerprint(MODEL_FINGERPRINT, content))
        return root


class AdapterCaches:
    """Every simulated replica's LRU of loaded adapters, and what it last published."""

    def __init__(self, args: argparse.Namespace, replica_ids: list[str]) -> None:
        self.capacity = args.max_cpu_loras
        self.load_s = args.adapter_load_ms / 1000
        self.loaded: dict[str, "OrderedDict[str, None]"] = {rid: OrderedDict() for rid in replica_ids}
        self.published: dict[str, frozenset] = {rid: frozenset() for rid in replica_ids}
        self.holders: dict[str, list[str]] = {}
        self.num_loads = self.num_evictions = self.num_requests = 0

    def publish(self) -> None:
        """Takes every replica's stats snapshot (called when the fleet publishes its stats)."""
        self.published = {rid: frozenset(lru) for rid, lru in self.loaded.items()}
        holders: dict[str, list[str]] = {}
        for rid, names in self.published.items():
            for name in names:
                holders.setdefault(name, []).append(rid)
        self.holders = holders

    def view_fields(self, rid: str, adapter: str) -> dict[str, Any]:
        """The ``ReplicaView`` fields of a replica's last published adapters."""
        names = self.published[rid]
        return {"holds_adapter": (adapter in names) if adapter else None, "num_adapters": len(names),
                "max_adapters": self.capacity}

    def use(self, rid: str, adapter: str) -> float:
        """Runs ``adapter`` on ``rid`` ("": the base model): the seconds its load takes (0 when loaded)."""
        if not adapter:
            return 0.0
        self.num_requests += 1
        lru = self.loaded[rid]
        if adapter in lru:
            lru.move_to_end(adapter)
            return 0.0
        self.num_loads += 1
        lru[adapter] = None
        while len(lru) > self.capacity:
            lru.popitem(last=False)
            self.num_evictions += 1
        return self.load_s

    def results(self, duration_s: float) -> dict[str, Any]:
        minutes = max(duration_s, 1e-9) / 60
        return {"adapter_loads_per_min": round(self.num_loads / minutes, 1),
                "adapter_evictions_per_min": round(self.num_evictions / minutes, 1),
                "adapter_load_fraction": round(self.num_loads / max(self.num_requests, 1), 4)}
