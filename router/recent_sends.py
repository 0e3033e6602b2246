"""The prefixes this router sent to each replica in the last few seconds.

The directory learns a request's blocks only after the replica computed them
(one engine step, then a publish): for a second or so after a router sends a
new prefix to a replica, the directory says nobody holds it, and a burst of
requests for that prefix would be spread over replicas that each compute it
again. A router therefore also credits a replica with the leading blocks of
chains *it sent there* within ``ttl_s``: a short-lived hint (expires, never
refreshed, never shared), which at worst costs a recompute on the replica,
never a wrong answer (the replica re-checks every block by hash).
"""

from __future__ import annotations

from collections import deque
from typing import Sequence


class RecentSends:
    """Chains sent per replica, remembered for ``ttl_s`` seconds.

    Only every ``stride``-th block of a chain (and its last block) is kept: a
    credit is rounded down to such a checkpoint, and recording a send costs
    ``len(chain) / stride`` entries.

    Args:
        ttl_s: How long a send is credited (> 0).
        max_entries: Most (block, replica) entries kept; the oldest go first.
        stride: Blocks between checkpoints (>= 1).
    """

    def __init__(self, ttl_s: float = 5.0, max_entries: int = 200_000, stride: int = 4) -> None:
        if not ttl_s > 0 or max_entries < 1 or stride < 1:
            raise ValueError(f"ttl_s must be > 0, max_entries and stride >= 1, got {ttl_s!r}, {max_entries!r}, "
                             f"{stride!r}")
        self.ttl_s = float(ttl_s)
        self.max_entries = max_entries
        self.stride = stride
        self._holders: dict[bytes, dict[str, float]] = {}  # block hash -> {replica id: expiry}
        self._order: deque[tuple[float, bytes, str]] = deque()  # (expiry, hash, replica) in send order

    def record(self, chain: Sequence[bytes], replica_id: str, now: float) -> None:
        """Remembers that ``chain`` was sent to ``replica_id`` at ``now``."""
        expiry = now + self.ttl_s
        for depth in self._checkpoints(len(chain)):
            block = chain[depth]
            self._holders.setdefault(block, {})[replica_id] = expiry
            self._order.append((expiry, block, replica_id))
        self._expire(now)

    def leading(self, chain: Sequence[bytes], now: float) -> dict[str, int]:
        """``{replica: leading blocks of chain sent there within ttl_s}``, holders only."""
        self._expire(now)
        counts: dict[str, int] = {}
        alive = None
        for depth in self._checkpoints(len(chain)):
            holders = self._holders.get(chain[depth])
            here = {r for r, expiry in holders.items() if expiry > now} if holders else set()
            alive = here if alive is None else alive & here
            if not alive:
                break
            for replica_id in alive:
                counts[replica_id] = depth + 1
        return counts

    def __len__(self) -> int:
        return len(self._order)

    def _checkpoints(self, length: int) -> list[int]:
        """Depths kept of a chain of ``length`` blocks: every stride-th, and the last."""
        depths = list(range(self.stride - 1, length, self.stride))
        if length and (not depths or depths[-1] != length - 1):
            depths.append(length - 1)
        return depths

    def _expire(self, now: float) -> None:
        while self._order and (self._order[0][0] <= now or len(self._order) > self.max_entries):
            expiry, block, replica_id = self._order.popleft()
            holders = self._holders.get(block)
            if holders is not None and holders.get(replica_id) == expiry:
                del holders[replica_id]
                if not holders:
                    del self._holders[block]
