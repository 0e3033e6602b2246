"""A Ray Serve ``RequestRouter`` that applies a policy from ``router.policies``
without a Redis call per request.

For each request (a ``GenerationRequest`` as the first argument) it

1. computes the block-hash chain of the prompt (``cluster.shared.hashing``; the
   replicas hash the same way, with the same model fingerprint and the
   request's ``cache_salt``),
2. asks the prefix directory which replicas hold how many leading blocks:
   by default the router's local copy, kept by an ``IndexFollower`` from the
   directory's event stream (``directory_lookup="index"``; memory only), or
   one Lua call per request (``"redis"``). Not in sync / ``DirectoryError``
   -> no confirmed cache, load-only,
3. hands the answer to the decision core (``router/decision.py``, shared with
   ``prefixserve simulate``): chains this router sent in the last seconds are
   credited, candidates are picked (all replicas of a small fleet), and a
   ``ReplicaView`` is built per candidate: its ongoing requests from Serve's
   queue-length cache (fresh) split into running / waiting / swapped by its
   routing stats (``record_routing_stats``, about a second old), its work in
   tokens from those stats plus the prompt tokens this router sent since, and
4. returns the policy's ranking, one replica per rank, so Serve falls back
   to the next one when a replica rejects (full queue). Each decision goes to
   the request it was computed for (no ``FIFOMixin``, see the class).
5. writes the ranking's fetch hints into the request
   (``GenerationRequest.kv_fetch_from``: replica -> the holder to fetch the
   prefix's KV from; Serve serializes the arguments after this call, so the
   hint travels with the request to whichever replica of the ranking takes
   it, over any transport). A replica fetches through its own handle to the
   deployment: its ``export_kv`` call names the holder (``holder_id``) and is
   routed to that replica alone (to the least loaded one when the holder has
   left: it answers with what it holds, checked by hash).

Requests that are not ``GenerationRequest``s (stats, resets) are routed by
load alone, ties broken at random (so repeated calls reach every replica).

Cache contract: with ``cache_contract`` set (the builder sets it), a replica
that registered a different one (block size, hash scheme, model or
tokenizer; ``cluster.shared.contract``) answers -1 in the lookup and is
*refused*: left out of the ranking, with one warning naming the fields that
differ and the ``prefixserve:router_refused_replicas`` gauge. It stays
refused while the directory is down. Only when every candidate is refused
does the router rank them all by load, with an error log, so a misconfigured
router degrades to load-only routing instead of dropping every request.

Each decision of a ``GenerationRequest`` is timed into
``prefixserve:router_decision_seconds`` and, when the directory answered,
the chosen replica's matched / request blocks into
``prefixserve:router_prefix_match_ratio``; failed lookups count in
``prefixserve:router_directory_errors_total`` (``router/metrics.py``).
"""

from __future__ import annotations

import logging
import math
import random
import time
from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from cluster.shared.contract import CacheContract
from cluster.shared.directory import Directory, DirectoryError, DirectoryUnavailable
from cluster.shared.directory.follower import IndexFollower
from cluster.shared.hashing import hash_block_chain, lora_fingerprint, root_hash
from cluster.shared.types import GenerationRequest
from router.metrics import get_router_metrics
from router.decision import RoutingCore
from router.policies import ReplicaView, get_policy
from router.policies.base import Ranking
from router.policies.disagg import pair, role_of

logger = logging.getLogger(__name__)

FIRST_SYNC_WAIT_S = 1.0  # the first decisions of a new router wait this long for its index


class PrefixAwareRequestRouter(RequestRouter):
    """Routes on confirmed prefix matches and load (see module doc).

    No ``FIFOMixin``: Serve runs several routing tasks at once, and the mixin
    hands the replica chosen for one request to the *oldest* pending one, so
    a decision computed from request B's prefix could go to request A when
    B's directory lookup answered first. Serve's default matches the chosen
    replica to the request it was computed for (by internal request id).
    """

    def initialize_state(
        self,
        redis_url: Optional[str] = None,
        namespace: str = "default",
        policy: str = "prefix_cost",
        policy_params: Optional[dict[str, Any]] = None,
        block_size: int = 16,
        model_fingerprint: str = "",
        cache_contract: str = "",
        num_routers: int = 1,
        directory_lookup: str = "index",
        prefill_replicas: int = 0,
    ) -> None:
        """Called by Serve with ``request_router_kwargs``."""
        if directory_lookup not in ("index", "redis"):
            raise ValueError(f"directory_lookup must be 'index' or 'redis', got {directory_lookup!r}")
        self._directory = Directory.from_url(redis_url, namespace) if redis_url else None
        # "index": a local copy of the directory followed through its event stream
        # (its own connections, longer timeouts: snapshots can be large); a
        # decision then costs no Redis call. "redis": one LOOKUP script per request.
        self._follower = (IndexFollower(Directory.from_url(redis_url, namespace, socket_timeout_s=5.0))
                          if redis_url and directory_lookup == "index" else None)
        self._policy = get_policy(policy, **(policy_params or {}))
        self._block_size = block_size
        self._fingerprint = model_fingerprint
        self.num_directory_errors = 0
        self._directory_down = False
        self._metrics = get_router_metrics(namespace, policy)
        self._contract = cache_contract
        self._refused: set[str] = set()  # replica ids whose contract differs from ours
        self._routed_around: list[str] = []  # replicas Serve still offers that the directory lists as dead
        # Recent sends, per-prefix rates, tokens sent since each replica's stats,
        # candidate sampling: the part of a decision the simulator shares.
        self._core = RoutingCore(self._policy, block_size, num_routers=num_routers)
        self._prefill_replicas = prefill_replicas  # disaggregated prefill (router/policies/disagg.py); 0: off

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = _generation_request(pending_request)
        if request is None:
            target = _export_target(pending_request)
            if target:
                chosen = [r for r in candidate_replicas if r.replica_id.unique_id == target]
                if chosen:
                    return [chosen]
            return self._by_load(candidate_replicas)
        try:
            return await self._choose_for(request, candidate_replicas)
        except Exception:  # noqa: BLE001 - a routing task that raises leaves its request waiting forever
            logger.exception("routing decision for request %s failed; routing it on load only", request.request_id)
            return self._by_load(candidate_replicas)

    def _by_load(self, candidate_replicas: List[RunningReplica]) -> List[List[RunningReplica]]:
        # Stats, resets, health, and the fallback: least load, ties broken at
        # random so that repeated calls reach every idle replica (the policies
        # break ties by id, which would always pick the same one).
        views = [self._view(r, None) for r in candidate_replicas]
        load = {v.replica_id: v.num_running + v.num_waiting + v.num_swapped for v in views}
        shuffled = random.sample(candidate_replicas, len(candidate_replicas))
        return [[r] for r in sorted(shuffled, key=lambda r: load[r.replica_id.unique_id])]

    async def _choose_for(self, request: GenerationRequest,
                          candidate_replicas: List[RunningReplica]) -> List[List[RunningReplica]]:
        began = time.perf_counter()
        fingerprint = self._fingerprint
        adapter = request.lora_request.lora_name if request.lora_request is not None else ""
        if adapter:
            fingerprint = self._adapter_fingerprint(adapter, candidate_replicas)
        chain = hash_block_chain(request.prompt_token_ids, self._block_size, root_hash(fingerprint, request.cache_salt))
        counts = await self._lookup(chain)
        if counts is not None:
            await self._note_contracts(counts)
            counts = {rid: n for rid, n in counts.items() if n >= 0}
        candidate_replicas = self._live(self._compatible(candidate_replicas), counts)
        if request.avoid_replica_ids:  # a stalled replica the directory may still list (router/migration.py)
            candidate_replicas = [r for r in candidate_replicas
                                  if r.replica_id.unique_id not in request.avoid_replica_ids] or candidate_replicas
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        holders = [rid for rid, r in by_id.items() if adapter and _holds(r.routing_stats or {}, adapter)]
        ranking = self._core.decide_ranking(chain, len(request.prompt_token_ids), list(by_id), counts,
                                            lambda rid, matched: self._view(by_id[rid], matched, adapter),
                                            adapter=adapter, adapter_holders=holders)
        ranking, request.kv_prefill_first = self._disaggregated(ranking, by_id, counts, request, adapter)
        ranked = ranking.replica_ids
        # Replaced, not updated: a request routed again (a rejection, a migration) carries this decision's.
        request.kv_fetch_from = {rid: holder for rid, holder in ranking.fetch_from.items() if holder in by_id}
        matched = counts.get(ranked[0], 0) if counts is not None and ranked else None
        self._metrics.record_decision(time.perf_counter() - began, matched, len(chain))
        return [[by_id[replica_id]] for replica_id in ranked]

    def _disaggregated(self, ranking: Ranking, by_id: dict[str, RunningReplica], counts: Optional[dict[str, int]],
                       request: GenerationRequest, adapter: str) -> tuple[Ranking, bool]:
        """Decode replicas first, each hinted to have the first prefill replica prefill and
        hand the KV over (``router/policies/disagg.py``); the ranking as it is when off."""
        if not self._prefill_replicas:
            return ranking, False
        roles = {rid: role_of(_rank_of(r), self._prefill_replicas) for rid, r in by_id.items()}
        paired = pair(ranking, roles, counts or {}, len(request.prompt_token_ids), self._block_size, bool(adapter))
        return Ranking(paired.replica_ids, paired.fetch_from), paired.prefill_first

    def _adapter_fingerprint(self, name: str, candidates: List[RunningReplica]) -> str:
        """What the replicas hash a LoRA adapter's blocks with: the model's fingerprint and
        the adapter's content hash, which a replica that loaded it sends in its routing
        stats (none has yet: a fingerprint that matches no block, so load decides)."""
        for replica in candidates:
            for held, content in (replica.routing_stats or {}).get("lora_adapters", ()):
                if held == name:
                    return lora_fingerprint(self._fingerprint, content)
        return f"{self._fingerprint}/lora-not-loaded:{name}"

    def _live(self, candidates: List[RunningReplica], counts: Optional[dict[str, int]]) -> List[RunningReplica]:
        """The candidates the directory lists as live, when it can tell and lists
        any: a replica that stopped heartbeating (its node stalled, its process
        frozen) drops out of the directory within its TTL, long before Serve's
        health check gives up on it. Unknown (no answer): every candidate."""
        if counts is None:
            return candidates
        if self._follower is not None:
            if not self._follower.in_sync:
                return candidates
            live = set(self._follower.index.replica_ids())
        else:
            live = set(counts)  # the Lua lookup names every live replica
        alive = [r for r in candidates if r.replica_id.unique_id in live]
        if not alive or len(alive) == len(candidates):
            return candidates
        gone = sorted(r.replica_id.unique_id for r in candidates if r.replica_id.unique_id not in live)
        if gone != self._routed_around:
            logger.warning("routing around replicas the directory no longer lists as live: %s", ", ".join(gone))
            self._routed_around = gone
        return alive

    async def _note_contracts(self, counts: dict[str, int]) -> None:
        """Sets the refused replicas from a lookup's answer, which names every
        replica whose contract differs (-1) whatever the chain."""
        refused = {replica_id for replica_id, hits in counts.items() if hits < 0}
        for replica_id in self._refused - refused:
            logger.info("replica %s no longer declares another cache contract: routing to it again", replica_id)
        for replica_id in refused - self._refused:
            try:
                theirs = await self._directory.replica_contract(replica_id)
            except DirectoryError:
                theirs = "(unreadable)"
            differs = CacheContract.decode(self._contract).differences(theirs) if theirs else ["(gone)"]
            logger.warning("refusing replica %s: its cache contract differs from this router's (%s); "
                           "deploy routers and replicas with the same model, tokenizer and block_size",
                           replica_id, "; ".join(differs))
        self._refused = refused
        self._metrics.refused_replicas.set(len(refused))

    def _compatible(self, candidates: List[RunningReplica]) -> List[RunningReplica]:
        if not self._refused:
            return candidates
        kept = [r for r in candidates if r.replica_id.unique_id not in self._refused]
        if kept:
            return kept
        logger.error("every replica (%d) declares a cache contract other than this router's; routing on load "
                     "only until they match", len(candidates))
        return candidates

    async def _lookup(self, chain: list[bytes]) -> Optional[dict[str, int]]:
        if self._directory is None or not chain:
            return None
        try:
            if self._follower is not None:
                self._follower.start()  # on the routing loop, once
                if not self._follower.num_full_syncs:  # just started: give the first sync a moment
                    await self._follower.wait_in_sync(FIRST_SYNC_WAIT_S)
                counts = self._follower.lookup(chain, self._contract)
                if counts is None:
                    raise DirectoryUnavailable("the local index is not in sync with the directory")
            else:
                counts = await self._directory.lookup(chain, self._contract)
        except DirectoryError as exc:
            self.num_directory_errors += 1
            self._metrics.record_directory_error()
            # Once per outage, not once per request (the counter and metric count them all).
            log = logger.debug if self._directory_down else logger.warning
            log("prefix directory unavailable, routing on load only: %s", exc)
            self._directory_down = True
            return None
        self._metrics.record_directory_ok()
        if self._directory_down:
            logger.info("prefix directory reachable again, routing on cached prefixes")
            self._directory_down = False
        return counts

    def _view(self, replica: RunningReplica, matched: Optional[int], adapter: str = "") -> ReplicaView:
        replica_id = replica.replica_id.unique_id
        stats = replica.routing_stats or {}
        running = int(stats.get("num_running", 0))
        waiting = int(stats.get("num_waiting", 0))
        swapped = int(stats.get("num_swapped", 0))
        # Routing stats are a snapshot the controller pulls about once a
        # second: they still count requests that finished since. Serve's
        # queue-length cache is fresher (+1 on each send, -1 on completion,
        # corrected by the replica's own count when it accepts), so when it has an
        # entry it gives the number of ongoing requests and the stats only
        # split it. (Taking the larger of the two made a replica that had just
        # finished look busy and sent the next request to a busy one.)
        queued = self._replica_queue_len_cache.get(replica.replica_id)
        if queued is not None:
            swapped = min(swapped, queued)
            waiting = min(waiting, queued - swapped)
            running = queued - waiting - swapped
        return ReplicaView(
            replica_id=replica_id,
            num_running=running,
            num_waiting=waiting,
            num_swapped=swapped,
            kv_cache_usage=min(1.0, max(0.0, float(stats.get("kv_cache_usage", 0.0)))),
            num_cached_blocks=int(stats.get("num_cached_blocks", 0)),
            matched_blocks=matched,
            num_prefill_tokens=max(0, int(stats.get("num_prefill_tokens", 0))) + self._core.pending_tokens(
                replica_id, float(stats.get("at", 0.0))),
            num_decode_tokens=max(0, int(stats.get("num_decode_tokens", 0))),
            num_kv_blocks=max(0, int(stats.get("num_kv_blocks", 0))),
            # Placement of the request's LoRA adapter (router/policies/lora_placement.py); None: no
            # adapter, or stats from before the replica reported its adapters.
            holds_adapter=_holds(stats, adapter) if adapter and "lora_adapters" in stats else None,
            num_adapters=len(stats.get("lora_adapters", ())),
            max_adapters=max(0, int(stats.get("max_cpu_loras", 0))),
            adapter_load_tokens=_finite_nonnegative(stats.get("lora_load_tokens", 0.0)),
            core_group=str(stats.get("core_group", "") or ""),
            kv_bytes_per_token=_finite_nonnegative(stats.get("kv_bytes_per_token", 0.0)),
            num_exports=self._core.exports_in_flight(replica_id),
        )


def _finite_nonnegative(value: Any) -> float:
    """A replica's reported float, 0.0 when it is not a finite number >= 0."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return 0.0
    return value if math.isfinite(value) and value > 0 else 0.0


def _holds(stats: dict, adapter: str) -> bool:
    """Whether routing stats list ``adapter`` among the replica's loaded LoRA adapters."""
    return any(name == adapter for name, _ in stats.get("lora_adapters", ()))


def _rank_of(replica: RunningReplica) -> Optional[int]:
    """The replica's Serve rank as it reported it (``workers/disagg.py``), or None."""
    rank = (getattr(replica, "replica_metadata", None) or {}).get("rank")
    return rank if isinstance(rank, int) else None


def _export_target(pending: Optional[PendingRequest]) -> str:
    """The replica a KV export, disaggregated-prefill or hand-over call names
    (``ReplicaServer.export_kv``'s, ``prefill_kv``'s or ``import_kv``'s ``holder_id``), or ""."""
    if pending is None or getattr(pending.metadata, "call_method", "") not in ("export_kv", "prefill_kv",
                                                                                "import_kv"):
        return ""
    return str(pending.kwargs.get("holder_id", "") or "")


def _generation_request(pending: Optional[PendingRequest]) -> Optional[GenerationRequest]:
    if pending is None:
        return None
    for arg in list(pending.args) + list(pending.kwargs.values()):
        if isinstance(arg, GenerationRequest):
            return arg
    return None
