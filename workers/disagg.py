"""Disaggregated prefill, the replica's side (issue 33 item 4, docs/DISAGGREGATION.md):
``ReplicaServer``'s ``prefill_kv`` endpoint and the decode replica's
"prefill there, pull, decode here", on the pull path of docs/KV_TRANSFER.md.

The request router (``router/policies/disagg.py``) picks a pair: a prefill
replica P and a decode replica D. The request goes to D alone, with
``kv_fetch_from = {D: P}`` and ``kv_prefill_first``. D, inside its TTFT::

    D: fetch_hinted (this mixin, before the fetch of kv_transfer_endpoints.py)
         handle.options(method_name="prefill_kv").remote(prompt, salt, holder_id=P)
    router (in D's process): call_method prefill_kv with holder_id -> [[P]]
    P: prefill_kv -> the prompt runs with max_tokens 1 (the token is dropped, as
         vLLM's disaggregated-prefill proxy does); its full blocks are committed to
         P's prefix cache when computed, and stay cached (free, LRU) once it ends
    D: KVTransferEndpoints.fetch_hinted -> export_kv on P -> import, commit
    D: generate -> admission hits the imported blocks; D computes the last
         partial block and decodes

Nothing is lost when P fails: a prefill that raises, times out
(``prefill_timeout_s``) or cannot be reached skips the fetch, and D prefills
the prompt itself, with the same tokens (a fetch that fails after a good
prefill does the same, docs/KV_TRANSFER.md's faults). Counted in
``prefixserve:kv_disagg_prefills_total{outcome}`` on D (``remote``, ``error``,
``timeout``, ``unreachable``) and P (``served``).

Why D drives it rather than the router's process: D already pulls KV through a
handle to its own deployment, the request's stream and cancellation stay one
Serve call, and the fallback (prefill here) needs no second routing decision.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Callable, Optional

from prometheus_client import Counter

from cluster.shared.metrics_format import METRIC_PREFIX
from cluster.shared.types import GenerationRequest, SamplingParams

logger = logging.getLogger(__name__)

PREFILL_METHOD = "prefill_kv"  # routed to the replica its holder_id names (router/serve_router.py)
DEFAULT_PREFILL_TIMEOUT_S = 120.0  # a long prompt's prefill on a loaded 2-core machine takes seconds
OUTCOMES = ("remote", "error", "timeout", "unreachable", "served")

PrefillerOf = Callable[[str], Optional[Any]]  # replica id -> has prefill_kv.remote(prompt, salt), or None


class ServePrefiller:
    """A replica of this deployment reached through a Serve handle, its ``prefill_kv`` call naming it."""

    def __init__(self, handle: Any, replica_id: str) -> None:
        self.prefill_kv = _NamedPrefill(handle.options(method_name=PREFILL_METHOD), replica_id)


class _NamedPrefill:
    def __init__(self, handle: Any, replica_id: str) -> None:
        self._handle = handle
        self._replica_id = replica_id

    def remote(self, prompt_token_ids: list[int], cache_salt: str = "") -> Any:
        return self._handle.remote(prompt_token_ids, cache_salt, holder_id=self._replica_id)


def serve_prefiller_of() -> Optional[PrefillerOf]:
    """Inside a Serve replica: a replica id -> ``ServePrefiller`` (one handle, made on first use);
    None outside Serve."""
    try:
        from ray import serve

        context = serve.get_replica_context()
    except Exception:  # noqa: BLE001 - not inside a Serve replica
        return None
    handles: list[Any] = []

    def prefiller_of(replica_id: str) -> Any:
        if not handles:
            handles.append(serve.get_deployment_handle(context.deployment, context.app_name))
        return ServePrefiller(handles[0], replica_id)

    return prefiller_of


class LocalPrefiller:
    """A replica in this process behind the ``prefill_kv.remote(...)`` shape (engine tests)."""

    def __init__(self, replica: Any) -> None:
        self.prefill_kv = _LocalCall(replica.prefill_kv)


class _LocalCall:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn

    def remote(self, *args: Any) -> Any:
        return self._fn(*args)


class DisaggregationEndpoints:
    """``ReplicaServer``'s disaggregation methods. Listed before ``KVTransferEndpoints`` among
    its bases: ``fetch_hinted`` here runs the remote prefill, then that class's fetch.
    Uses the replica's ``_front``, ``metrics``, ``replica_id`` and ``kv_transfer``."""

    prefiller_of: Optional[PrefillerOf] = None  # None: Serve's handle (serve_prefiller_of) when under Serve
    prefill_timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S
    _disagg_prefills: Optional[Counter] = None
    last_remote_prefill_s: float = 0.0  # the last prefill asked of a prefill replica, seconds
    _pull_slots_of: Optional[tuple[asyncio.AbstractEventLoop, asyncio.Semaphore]] = None

    def record_replica_metadata(self) -> dict[str, Any]:
        """Serve's static per-replica metadata, read once by the request routers: the
        replica's rank in its deployment, from which the router derives its role
        (``prefill_replicas``, docs/DISAGGREGATION.md). Empty outside Serve."""
        try:
            from ray import serve

            rank = serve.get_replica_context().rank
        except Exception:  # noqa: BLE001 - not inside a Serve replica
            return {}
        return {"rank": int(getattr(rank, "rank", rank))}

    async def prefill_kv(self, prompt_token_ids: list[int], cache_salt: str = "", holder_id: str = "") -> int:
        """Prefills the prompt here so that a decode replica can pull its KV; returns the
        prompt tokens whose full blocks are cached here now (the decode replica fetches
        those). ``holder_id``: the replica the caller meant (the request router routes on it).

        Raises:
            ValueError: The prompt is invalid (empty, too long).
        """
        prompt = [int(t) for t in prompt_token_ids]
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        request = GenerationRequest(f"prefill-{uuid.uuid4().hex[:12]}", prompt, params, cache_salt=cache_salt)
        async for _ in self._front.generate(request):  # type: ignore[attr-defined]
            pass  # the token is dropped: the decode replica computes its own from the same KV
        hashes, _ = self.kv_transfer.prefix_hashes(prompt, cache_salt)  # type: ignore[attr-defined]
        self._count_prefill("served")
        return self.kv_transfer.ledger.num_cached_leading(hashes) * self.kv_transfer.ledger.pool.block_size  # type: ignore[attr-defined]

    async def fetch_hinted(self, request: Any) -> int:
        """With ``request.kv_prefill_first``: asks the hinted replica to prefill the prompt,
        then fetches its blocks (``KVTransferEndpoints.fetch_hinted``); a prefill that fails
        skips the fetch (this replica prefills). Returns the prompt tokens imported."""
        hints = getattr(request, "kv_fetch_from", None) or {}
        prefill_on = hints.get(self.replica_id, "")  # type: ignore[attr-defined]
        if (getattr(request, "kv_prefill_first", False) and prefill_on and prefill_on != self.replica_id  # type: ignore[attr-defined]
                and request.lora_request is None):
            if not await self._prefill_remotely(prefill_on, request):
                return 0
            # The prefill is paid: wait for a fetch slot rather than be refused at the limit (``busy``)
            # and prefill again here. A pull takes tens of milliseconds; other fetches still race for slots.
            async with self._pull_slots():
                return await super().fetch_hinted(request)  # type: ignore[misc]
        return await super().fetch_hinted(request)  # type: ignore[misc]

    def _pull_slots(self) -> asyncio.Semaphore:
        """Pulls after a remote prefill, at most the replica's fetch limit at once (one
        semaphore per event loop: Serve has one; tests run several in turn)."""
        loop = asyncio.get_running_loop()
        if self._pull_slots_of is None or self._pull_slots_of[0] is not loop:
            limit = self.kv_transfer.max_concurrent_transfers  # type: ignore[attr-defined]
            self._pull_slots_of = (loop, asyncio.Semaphore(limit))
        return self._pull_slots_of[1]

    async def _prefill_remotely(self, replica_id: str, request: Any) -> bool:
        if self.prefiller_of is None:
            self.prefiller_of = serve_prefiller_of()
        prefiller = self.prefiller_of(replica_id) if self.prefiller_of is not None else None
        if prefiller is None:
            logger.warning("prefill on %s asked, but this replica cannot reach other replicas (not under "
                           "Serve); it prefills request %s itself", replica_id, request.request_id)
            self._count_prefill("unreachable")
            return False
        began = time.perf_counter()
        try:
            num_tokens = await asyncio.wait_for(prefiller.prefill_kv.remote(request.prompt_token_ids,
                                                                            request.cache_salt),
                                                self.prefill_timeout_s)
        except asyncio.TimeoutError:
            logger.warning("prefill of request %s on %s took over %.0f s; prefilling it here", request.request_id,
                           replica_id, self.prefill_timeout_s)
            self._count_prefill("timeout")
            return False
        except Exception as exc:  # noqa: BLE001 - the prefill replica died or refused: prefill here
            logger.warning("prefill of request %s on %s failed (%r); prefilling it here", request.request_id,
                           replica_id, exc)
            self._count_prefill("error")
            return False
        self.last_remote_prefill_s = time.perf_counter() - began  # the bench reads it
        logger.debug("request %s prefilled on %s: %s tokens cached there in %.3f s", request.request_id,
                     replica_id, num_tokens, self.last_remote_prefill_s)
        self._count_prefill("remote")
        return True

    def _count_prefill(self, outcome: str) -> None:
        assert outcome in OUTCOMES, outcome
        metrics = getattr(self, "metrics", None)
        if metrics is None:
            return
        labels = dict(getattr(metrics, "_labels", {"replica": "", "model": ""}))
        if self._disagg_prefills is None:  # made on first use, in the replica's registry
            self._disagg_prefills = Counter(
                METRIC_PREFIX + "kv_disagg_prefills", "Disaggregated prefills: asked of a prefill replica "
                "(remote, error, timeout, unreachable) or served here (served).", (*labels, "outcome"),
                registry=metrics.registry)
        self._disagg_prefills.labels(**labels, outcome=outcome).inc()

    def disagg_prefill_count(self, outcome: str) -> float:
        """``kv_disagg_prefills_total{outcome}`` of this replica (tests, benches); 0 when absent."""
        metrics = getattr(self, "metrics", None)
        if metrics is None or self._disagg_prefills is None:
            return 0.0
        labels = dict(getattr(metrics, "_labels", {"replica": "", "model": ""}))
        got = metrics.registry.get_sample_value(METRIC_PREFIX + "kv_disagg_prefills_total",
                                                {**labels, "outcome": outcome})
        return float(got or 0.0)
