"""The tiny interface every routing policy implements.

A policy is a pure function of one ``RoutingInput``: the request's size (its
block-hash chain length) and one ``ReplicaView`` per live replica (load, KV
use and, when the Redis directory answered, how many leading blocks of the
chain the replica holds). It returns *every* replica id, best first; the
Serve ``RequestRouter`` tries them in that order, so a replica that rejects
(full queue, gone) costs one step down the list, not a new decision.

Nothing here (or anywhere under ``router/policies``) does I/O or imports
torch, ray, redis or workers: policies are tested with hand-built views.

The load measure shared by the load-based policies:

    load = num_running + num_waiting + swapped_weight * num_swapped

and the least-load order sorts by ``(load, kv_cache_usage, replica_id)``:
fewest in-flight sequences first, then the emptier KV cache, then the id
(so the order is total and every router process agrees on it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Protocol, Sequence, runtime_checkable

from cluster.shared.types import ReplicaStats

# A swapped-out sequence still has to finish, and must first copy its KV back
# from the CPU swap space: count it like a queued request.
DEFAULT_SWAPPED_WEIGHT = 1.0


@dataclass(frozen=True)
class ReplicaView:
    """What a policy knows about one live replica for one request.

    Args:
        replica_id: Serve replica id (unique within one ``RoutingInput``).
        num_running: Sequences in the replica's running batch.
        num_waiting: Sequences queued and not yet admitted.
        num_swapped: Preempted sequences whose KV sits in CPU swap space.
        kv_cache_usage: Used device KV blocks / total, in [0, 1].
        num_cached_blocks: Blocks the replica's prefix cache holds (informational).
        matched_blocks: Leading blocks of this request's hash chain that the
            directory confirms the replica holds; ``None`` when the directory
            could not be consulted (Redis down) or does not know the replica.
        num_prefill_tokens: Prompt tokens queued or running there whose KV is
            not computed yet (the replica's own count, plus what this router
            sent since that count was taken).
        num_decode_tokens: Context tokens of its decoding sequences.
        num_kv_blocks: Its device KV pool in blocks (0: unknown).
        holds_adapter: Whether it has the request's LoRA adapter loaded;
            ``None`` for a base-model request or a replica that did not say.
        num_adapters: LoRA adapters it has loaded.
        max_adapters: Adapters it keeps loaded at most (``max_cpu_loras``;
            0: unknown): loading one more when full evicts one.
        adapter_load_tokens: What loading an adapter costs it, in prefill
            tokens, as it measured (0: not measured; the policy's default).
        core_group: Non-empty for a replica that splits one machine's cores
            with the others of the same group (``workers/core_share.py``; its
            Ray node's core-share board): a second busy replica there halves the first's
            threads and reads the weights again each step. "" for a replica
            with cores of its own.
        kv_bytes_per_token: Bytes of its KV cache per token, all layers and
            ranks (0: not reported; ``prefix_cost`` then uses its
            ``kv_bytes_per_token`` parameter to price a fetch).
        num_exports: Fetches of its blocks in flight that the router knows of
            (its own recent fetch hints naming it, ``RoutingCore.exports_in_flight``):
            a holder at its export limit refuses the next.
    """

    replica_id: str
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_cache_usage: float = 0.0
    num_cached_blocks: int = 0
    matched_blocks: Optional[int] = None
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_kv_blocks: int = 0
    holds_adapter: Optional[bool] = None
    num_adapters: int = 0
    max_adapters: int = 0
    adapter_load_tokens: float = 0.0
    core_group: str = ""
    kv_bytes_per_token: float = 0.0
    num_exports: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.replica_id, str) or not self.replica_id:
            raise ValueError(f"replica_id must be a non-empty string, got {self.replica_id!r}")
        for name in ("num_running", "num_waiting", "num_swapped", "num_cached_blocks", "num_prefill_tokens",
                     "num_decode_tokens", "num_kv_blocks", "num_adapters", "max_adapters", "adapter_load_tokens",
                     "kv_bytes_per_token", "num_exports"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{name} of replica {self.replica_id!r} must be >= 0, got {value!r}")
        if not 0.0 <= self.kv_cache_usage <= 1.0:
            raise ValueError(
                f"kv_cache_usage of replica {self.replica_id!r} must be in [0, 1], got {self.kv_cache_usage!r}"
            )
        if self.matched_blocks is not None and self.matched_blocks < 0:
            raise ValueError(
                f"matched_blocks of replica {self.replica_id!r} must be >= 0 or None, got {self.matched_blocks!r}"
            )

    @classmethod
    def from_stats(cls, stats: ReplicaStats, matched_blocks: Optional[int] = None,
                   adapter: str = "") -> "ReplicaView":
        """Builds a view from a replica's reported stats and its directory match.

        Args:
            stats: The replica's ``ReplicaStats``.
            matched_blocks: Its entry of ``Directory.lookup()`` (``None`` when
                the lookup failed or did not name this replica).
            adapter: The request's LoRA adapter ("": the base model).

        Returns:
            The view; ``kv_cache_usage`` is clamped to [0, 1] against float noise.
        """
        return cls(
            replica_id=stats.replica_id,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_swapped=stats.num_swapped,
            kv_cache_usage=min(1.0, max(0.0, stats.kv_cache_usage)),
            num_cached_blocks=stats.num_cached_blocks,
            matched_blocks=matched_blocks,
            num_prefill_tokens=stats.num_prefill_tokens,
            num_decode_tokens=stats.num_decode_tokens,
            num_kv_blocks=stats.num_kv_blocks,
            holds_adapter=any(name == adapter for name, _ in stats.lora_adapters) if adapter else None,
            num_adapters=len(stats.lora_adapters),
            max_adapters=stats.max_cpu_loras,
            adapter_load_tokens=stats.lora_load_tokens,
        )


@dataclass(frozen=True)
class RoutingInput:
    """Everything a policy may look at for one routing decision.

    Args:
        num_blocks: Full blocks in the request's hash chain (``h_1 .. h_n``).
        num_prompt_tokens: Prompt length in tokens.
        replicas: One view per live replica; ids must be unique.
        block_size: Tokens per block (0: ``num_prompt_tokens // num_blocks``).
        prefix_key: Identifies the request's prefix (its first block hash), for
            tie-breaks that every router computes alike; ``b""`` when the
            prompt has no full block.
        prefix_rate: Requests per second the cluster receives for this prefix
            (the router's estimate; 0 when unknown).
        adapter: The request's LoRA adapter name ("": the base model).
        adapter_rate: Requests per second the cluster receives for that
            adapter (the router's estimate; 0 when unknown).
    """

    num_blocks: int
    num_prompt_tokens: int
    replicas: tuple[ReplicaView, ...]
    block_size: int = 0
    prefix_key: bytes = b""
    prefix_rate: float = 0.0
    adapter: str = ""
    adapter_rate: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "replicas", tuple(self.replicas))
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {self.num_blocks!r}")
        if self.num_prompt_tokens < 0:
            raise ValueError(f"num_prompt_tokens must be >= 0, got {self.num_prompt_tokens!r}")
        if self.block_size < 0 or not self.prefix_rate >= 0 or not self.adapter_rate >= 0:
            raise ValueError(f"block_size, prefix_rate and adapter_rate must be >= 0, got {self.block_size!r}, "
                             f"{self.prefix_rate!r}, {self.adapter_rate!r}")
        ids = [r.replica_id for r in self.replicas]
        if len(set(ids)) != len(ids):
            raise ValueError(f"replica ids must be unique, got {sorted(ids)}")

    @property
    def tokens_per_block(self) -> int:
        """``block_size``, or the prompt's tokens per full block when not given."""
        if self.block_size:
            return self.block_size
        return self.num_prompt_tokens // self.num_blocks if self.num_blocks else 1

    @property
    def directory_available(self) -> bool:
        """Whether at least one replica has a confirmed match count (even 0)."""
        return any(r.matched_blocks is not None for r in self.replicas)


@runtime_checkable
class Policy(Protocol):
    """A routing policy: ranks replicas for one request.

    ``choose`` returns every replica id of ``inp.replicas`` exactly once, best
    first (an empty list when there is no replica). It never raises for a
    valid ``RoutingInput``. Stateful policies (round robin, random sampling)
    mutate only their own counter / RNG.
    """

    name: str

    def choose(self, inp: RoutingInput) -> list[str]:
        """Returns replica ids in preference order."""
        ...


@dataclass(frozen=True)
class Ranking:
    """A policy's answer with its hints: every replica id, best first, and for the
    replicas that were priced as fetching the request's prefix, the replica to
    fetch it from (``fetch_from[replica] = holder``; ``router/policies/kv_fetch.py``).
    Whoever sends the request to ``replica`` should have it fetch from the holder
    first; without that the replica prefills the prefix itself."""

    replica_ids: list[str]
    fetch_from: Mapping[str, str] = field(default_factory=dict)


def rank(policy: Policy, inp: RoutingInput) -> Ranking:
    """The policy's ``Ranking``: its ``rank(inp)`` where it has one (hints), else
    ``choose(inp)`` with no hints."""
    ranker = getattr(policy, "rank", None)
    return ranker(inp) if ranker is not None else Ranking(policy.choose(inp))


def replica_load(view: ReplicaView, swapped_weight: float = DEFAULT_SWAPPED_WEIGHT) -> float:
    """Returns ``num_running + num_waiting + swapped_weight * num_swapped``."""
    return view.num_running + view.num_waiting + swapped_weight * view.num_swapped


def load_key(view: ReplicaView, swapped_weight: float = DEFAULT_SWAPPED_WEIGHT) -> tuple[float, float, str]:
    """Sort key of the least-load order: load, then KV use, then id."""
    return (replica_load(view, swapped_weight), view.kv_cache_usage, view.replica_id)


def rank_by_load(replicas: Iterable[ReplicaView], swapped_weight: float = DEFAULT_SWAPPED_WEIGHT) -> list[ReplicaView]:
    """Returns the replicas sorted least loaded first (see ``load_key``)."""
    return sorted(replicas, key=lambda r: load_key(r, swapped_weight))


def ids_of(replicas: Sequence[ReplicaView]) -> list[str]:
    """Returns the replica ids of ``replicas``, in order."""
    return [r.replica_id for r in replicas]


def check_swapped_weight(swapped_weight: float) -> float:
    """Validates a ``swapped_weight`` parameter and returns it as a float."""
    if not swapped_weight >= 0.0:
        raise ValueError(f"swapped_weight must be >= 0, got {swapped_weight!r}")
    return float(swapped_weight)
