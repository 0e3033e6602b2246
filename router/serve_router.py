"""A Ray Serve ``RequestRouter`` that applies a policy from ``router.policies``
with one Redis round trip per request.

For each request (a ``GenerationRequest`` as the first argument) it

1. computes the block-hash chain of the prompt (``cluster.hashing``; the
   replicas hash the same way, with the same model fingerprint and the
   request's ``cache_salt``),
2. asks the prefix directory how many leading blocks each live replica holds
   (one Lua call; ``DirectoryError`` -> no confirmed cache, load-only),
3. builds a ``ReplicaView`` per candidate from its routing stats
   (``record_routing_stats``) and the router's own in-flight count, and
4. returns the policy's ranking, one replica per rank, so Serve falls back
   to the next one when a replica rejects (full queue).

Requests that are not ``GenerationRequest``s (stats, resets) are routed by
load alone.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from cluster.directory import Directory, DirectoryError
from cluster.hashing import hash_block_chain, root_hash
from cluster.types import GenerationRequest
from router.policies import ReplicaView, RoutingInput, get_policy

logger = logging.getLogger(__name__)


class PrefixAwareRequestRouter(FIFOMixin, RequestRouter):
    """Routes on confirmed prefix matches and load (see module doc)."""

    def initialize_state(
        self,
        redis_url: Optional[str] = None,
        namespace: str = "default",
        policy: str = "cache_aware",
        policy_params: Optional[dict[str, Any]] = None,
        block_size: int = 16,
        model_fingerprint: str = "",
    ) -> None:
        """Called by Serve with ``request_router_kwargs``."""
        self._directory = Directory.from_url(redis_url, namespace) if redis_url else None
        self._policy = get_policy(policy, **(policy_params or {}))
        self._block_size = block_size
        self._fingerprint = model_fingerprint
        self.num_directory_errors = 0

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = _generation_request(pending_request)
        chain: list[bytes] = []
        if request is not None:
            root = root_hash(self._fingerprint, request.cache_salt)
            chain = hash_block_chain(request.prompt_token_ids, self._block_size, root)
        counts = await self._lookup(chain)
        views = [self._view(r, counts) for r in candidate_replicas]
        num_tokens = len(request.prompt_token_ids) if request is not None else 0
        ranked = self._policy.choose(RoutingInput(len(chain), num_tokens, views))
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[replica_id]] for replica_id in ranked]

    async def _lookup(self, chain: list[bytes]) -> Optional[dict[str, int]]:
        if self._directory is None or not chain:
            return None
        try:
            return await self._directory.lookup(chain)
        except DirectoryError as exc:
            self.num_directory_errors += 1
            logger.warning("prefix directory unavailable, routing on load only: %s", exc)
            return None

    def _view(self, replica: RunningReplica, counts: Optional[dict[str, int]]) -> ReplicaView:
        replica_id = replica.replica_id.unique_id
        stats = replica.routing_stats or {}
        # Routing stats arrive every few seconds; the queue length Serve
        # probes is fresher. Take the larger so bursts are seen at once.
        queued = self._replica_queue_len_cache.get(replica.replica_id) or 0
        running = int(stats.get("num_running", 0))
        waiting = int(stats.get("num_waiting", 0))
        running = max(running, queued - waiting)
        return ReplicaView(
            replica_id=replica_id,
            num_running=running,
            num_waiting=waiting,
            num_swapped=int(stats.get("num_swapped", 0)),
            kv_cache_usage=min(1.0, max(0.0, float(stats.get("kv_cache_usage", 0.0)))),
            num_cached_blocks=int(stats.get("num_cached_blocks", 0)),
            matched_blocks=None if counts is None else counts.get(replica_id),
        )


def _generation_request(pending: Optional[PendingRequest]) -> Optional[GenerationRequest]:
    if pending is None:
        return None
    for arg in list(pending.args) + list(pending.kwargs.values()):
        if isinstance(arg, GenerationRequest):
            return arg
    return None
