"""A router-local copy of the prefix directory: block hash -> replicas.

``PrefixIndex`` is pure bookkeeping (no I/O): ``IndexFollower``
(``follower.py``) feeds it from the directory's event stream and snapshots,
the simulator (``cluster/bench/simulate.py``) from simulated replicas. A
lookup walks the request's chain through the inverted map, so its work is
the sum over matched blocks of the replicas holding each one -- it depends
on the matched prefix and on how many replicas hold it, not on the fleet.

Per replica the index keeps the epoch and the last applied batch number
(``seq``); a batch that does not follow (``seq != last + 1``) or comes from
another epoch is not applied and the replica becomes *unsynced*: lookups do
not credit it until a snapshot replaces its blocks (``load_snapshot``).
That is the same rule as the Redis side (docs/DIRECTORY.md): a replica is
never credited from a set that may have missed an eviction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence


@dataclass
class ReplicaEntry:
    """What the index knows about one replica."""

    epoch: int
    seq: int = -1  # last applied batch; -1: waiting for a snapshot
    contract: str = ""
    blocks: set = field(default_factory=set)

    @property
    def synced(self) -> bool:
        return self.seq >= 0


class PrefixIndex:
    """Inverted index of the replicas' cached blocks (see module doc).

    Attributes:
        lookup_ops: Membership operations done by ``lookup`` since creation
            (one per (matched block, holder) pair, plus one per probed block):
            the directory work of routing decisions, for benchmarks.
    """

    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}
        self._replicas: dict[str, ReplicaEntry] = {}
        self._contracts: dict[str, set[str]] = {}  # declared contract -> replica ids
        self.lookup_ops = 0

    # ------------------------------------------------------------- updates
    def register(self, replica_id: str, epoch: int, contract: str = "") -> None:
        """A (re)registration: the replica's blocks are dropped and it waits
        for a snapshot. An older epoch than the known one is ignored."""
        known = self._replicas.get(replica_id)
        if known is not None and known.epoch > epoch:
            return
        self._clear(replica_id)
        self._set_entry(replica_id, ReplicaEntry(epoch=epoch, contract=contract))

    def apply(self, replica_id: str, epoch: int, seq: int, cleared: bool, removed: Iterable[bytes],
              stored: Iterable[bytes]) -> bool:
        """Applies one KV event batch. Returns False (and unsyncs the replica
        when the epoch is current) if it does not follow the last batch."""
        entry = self._replicas.get(replica_id)
        if entry is None or entry.epoch != epoch:
            return False
        if not entry.synced or seq != entry.seq + 1:
            self.unsync(replica_id)
            return False
        if cleared:
            self._clear(replica_id)
        for block in removed:
            if block in entry.blocks:
                entry.blocks.discard(block)
                holders = self._holders.get(block)
                if holders is not None:
                    holders.discard(replica_id)
                    if not holders:
                        del self._holders[block]
        for block in stored:
            if block not in entry.blocks:
                entry.blocks.add(block)
                self._holders.setdefault(block, set()).add(replica_id)
        entry.seq = seq
        return True

    def load_snapshot(self, replica_id: str, epoch: int, seq: int, blocks: Iterable[bytes],
                      contract: str = "") -> None:
        """Replaces the replica's blocks with a snapshot taken at batch ``seq``
        (``seq < 0``: the replica itself waits for a resync: nothing credited)."""
        self._clear(replica_id)
        entry = ReplicaEntry(epoch=epoch, seq=seq if seq >= 0 else -1, contract=contract)
        self._set_entry(replica_id, entry)
        if entry.synced:
            for block in blocks:
                entry.blocks.add(block)
                self._holders.setdefault(block, set()).add(replica_id)

    def unsync(self, replica_id: str) -> None:
        """Stops crediting the replica until its next snapshot."""
        entry = self._replicas.get(replica_id)
        if entry is not None:
            self._clear(replica_id)
            entry.seq = -1

    def drop(self, replica_id: str) -> None:
        """Forgets a replica that left or died."""
        self._clear(replica_id)
        entry = self._replicas.pop(replica_id, None)
        if entry is not None:
            self._forget_contract(replica_id, entry.contract)

    # ------------------------------------------------------------- queries
    def lookup(self, chain: Sequence[bytes], contract: str = "") -> dict[str, int]:
        """``{replica: leading blocks of chain held}`` for the replicas that hold
        at least the first block, and ``-1`` for each replica whose declared
        contract differs from ``contract`` (both non-empty). Every other known
        replica holds none of the chain. Work: one probe per block walked plus
        the holders of each matched block (``lookup_ops``); nothing per replica.
        """
        counts: dict[str, int] = {}
        if contract:
            for declared, ids in self._contracts.items():
                if declared and declared != contract:
                    counts.update((rid, -1) for rid in ids)
        alive: Optional[set[str]] = None
        depth = 0
        for depth, block in enumerate(chain):
            self.lookup_ops += 1
            holders = self._holders.get(block)
            if not holders:
                break
            if alive is None:
                alive = {r for r in holders if r not in counts}
                self.lookup_ops += len(holders)
            else:
                # Set operations run in C; Python touches each replica once,
                # when it drops out (its count is the depth it reached).
                kept = alive & holders
                self.lookup_ops += len(alive)
                for replica_id in alive - kept if len(kept) < len(alive) else ():
                    counts[replica_id] = depth
                alive = kept
            if not alive:
                break
        else:
            depth = len(chain)
        for replica_id in alive or ():
            counts[replica_id] = depth
        return counts

    def replica(self, replica_id: str) -> Optional[ReplicaEntry]:
        return self._replicas.get(replica_id)

    def replica_ids(self) -> list[str]:
        return list(self._replicas)

    @property
    def num_entries(self) -> int:
        """(block, replica) pairs held: what the index's memory grows with."""
        return sum(len(e.blocks) for e in self._replicas.values())

    @property
    def num_blocks(self) -> int:
        """Distinct block hashes held by some replica."""
        return len(self._holders)

    def _set_entry(self, replica_id: str, entry: ReplicaEntry) -> None:
        old = self._replicas.get(replica_id)
        if old is not None:
            self._forget_contract(replica_id, old.contract)
        self._replicas[replica_id] = entry
        self._contracts.setdefault(entry.contract, set()).add(replica_id)

    def _forget_contract(self, replica_id: str, contract: str) -> None:
        ids = self._contracts.get(contract)
        if ids is not None:
            ids.discard(replica_id)
            if not ids:
                del self._contracts[contract]

    def _clear(self, replica_id: str) -> None:
        entry = self._replicas.get(replica_id)
        if entry is None:
            return
        for block in entry.blocks:
            holders = self._holders.get(block)
            if holders is not None:
                holders.discard(replica_id)
                if not holders:
                    del self._holders[block]
        entry.blocks = set()
