"""The router's Prometheus metrics and the cluster-wide ``GET /metrics``.

Router series (prefix ``prefixserve:``, like the replicas' in
``workers/metrics.py``)::

    router_requests_total{policy,outcome}    requests that reached routing, by how they ended:
                                             ok | invalid | overloaded | unavailable | cancelled | error
    router_decision_seconds{policy}          time of one routing decision (hash chain, one
                                             directory lookup, the policy's ranking)
    router_prefix_match_ratio{policy}        matched blocks / request blocks of the chosen replica
                                             (requests with at least one full block and a directory answer)
    router_directory_errors_total            directory calls that failed (routing fell back to load
                                             only, or a scrape missed the replicas' series)
    router_directory_available               1 while lookups succeed, 0 while routing on load only
    router_refused_replicas                  live replicas refused: their cache contract differs
    router_directory_degraded_seconds_total  time spent routing on load only (counted while an
                                             outage lasts, at each failed lookup, and when it ends)
    router_tenant_requests_total{tenant,outcome}  with API keys: requests per tenant (router/tenants.py)
                                             by admission: admitted | rate_limited | concurrency_limited
    router_tenant_tokens_total{tenant,kind}  tokens of finished requests per tenant:
                                             prompt | completion | cached_prompt
    router_continued_turn_tokens_total{kind} prompt tokens of Responses API turns continued by
                                             previous_response_id: prompt | cached_prompt (their ratio
                                             is the cached share of continued turns)
    router_continued_turn_cached_ratio       cached / prompt tokens of each continued turn
    router_metrics_exporter                  1 on the one router that exports the replicas' series

The ``tenant`` label takes only names of the tenants file (or ``default``),
so its cardinality is bounded by the configuration, never by clients.

One scrape of the router's HTTP port sees the whole cluster: ``ClusterMetrics``
renders the router's registry, then the live replicas' series, the latter on
one router per namespace only (a lease in the directory), so that sums over
the scrapes of several routers count each replica once. Replicas
publish their exposition text to the prefix directory with every heartbeat
(``Directory.publish_metrics``, same liveness TTL); the router reads the texts
of live replicas in one round trip (``Directory.replica_metrics``) and merges
them family by family, so each metric has one ``# HELP`` / ``# TYPE`` and a
dead replica's series vanish with its registration (docs/ARCHITECTURE.md,
"Metrics").

Serve builds the ``RequestRouter`` itself from picklable kwargs, so the
router process cannot hand it a registry: ``get_router_metrics(namespace,
policy)`` keeps one ``RouterMetrics`` per (namespace, policy) in this process,
which the request router, the backend and ``/metrics`` share.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, AsyncIterator, Mapping, Optional, Union

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from cluster.shared.directory import DirectoryError
from cluster.shared.metrics_format import METRIC_PREFIX as PREFIX
from cluster.shared.metrics_format import render_families, render_registry
from cluster.shared.types import StreamChunk
from router.errors import NoReplicaError, OverloadedError

logger = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_LATEST
DEFAULT_EXPORTER_TTL_S = 45.0  # three 15 s scrapes: one missed scrape does not move the lease
OUTCOMES = ("ok", "invalid", "overloaded", "unavailable", "cancelled", "error")
TENANT_OUTCOMES = ("admitted", "rate_limited", "concurrency_limited")
DECISION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
MATCH_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.99, 1.0)


class RouterMetrics:
    """The router's ``prefixserve:router_*`` series.

    Args:
        policy: Value of the ``policy`` label (the routing policy's name).
        registry: Where the metrics live; a fresh ``CollectorRegistry`` by default.
    """

    def __init__(self, policy: str, registry: Optional[CollectorRegistry] = None) -> None:
        self.policy = policy
        self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(PREFIX + "router_requests", "Requests that reached routing, by outcome.",
                                ("policy", "outcome"), registry=self.registry)
        self.decision_seconds = Histogram(PREFIX + "router_decision_seconds", "Time of one routing decision.",
                                          ("policy",), buckets=DECISION_BUCKETS, registry=self.registry)
        self.prefix_match_ratio = Histogram(
            PREFIX + "router_prefix_match_ratio", "Matched blocks / request blocks of the chosen replica.",
            ("policy",), buckets=MATCH_RATIO_BUCKETS, registry=self.registry)
        self.directory_errors = Counter(PREFIX + "router_directory_errors", "Failed prefix-directory calls.",
                                        registry=self.registry)
        self.directory_degraded_seconds = Counter(
            PREFIX + "router_directory_degraded_seconds",
            "Seconds this router routed on load only because the prefix directory was unreachable.",
            registry=self.registry)
        self.directory_available = Gauge(
            PREFIX + "router_directory_available",
            "1 while the last prefix-directory lookup succeeded, 0 while routing on load only.",
            registry=self.registry)
        self.directory_available.set(1)
        self.refused_replicas = Gauge(
            PREFIX + "router_refused_replicas",
            "Live replicas this router refuses because their cache contract (block size, hash scheme, model, "
            "tokenizer) differs from its own.", registry=self.registry)
        self.tenant_requests = Counter(PREFIX + "router_tenant_requests",
                                       "Requests per tenant (API key), by admission outcome.",
                                       ("tenant", "outcome"), registry=self.registry)
        self.tenant_tokens = Counter(PREFIX + "router_tenant_tokens",
                                     "Tokens of finished requests per tenant: prompt, completion, cached_prompt.",
                                     ("tenant", "kind"), registry=self.registry)
        self.continued_turn_tokens = Counter(
            PREFIX + "router_continued_turn_tokens",
            "Prompt tokens of Responses API turns continued by previous_response_id: prompt, cached_prompt.",
            ("kind",), registry=self.registry)
        self.continued_turn_cached_ratio = Histogram(
            PREFIX + "router_continued_turn_cached_ratio",
            "Cached / prompt tokens of one Responses API turn continued by previous_response_id.",
            buckets=MATCH_RATIO_BUCKETS, registry=self.registry)
        self.metrics_exporter = Gauge(
            PREFIX + "router_metrics_exporter",
            "1 on the router that exports the replicas' series (one per namespace), 0 on the others.",
            registry=self.registry)
        self._degraded_since: Optional[float] = None
        for outcome in OUTCOMES:  # export zeros, so rate() and alerts see every outcome at once
            self.requests.labels(policy, outcome)
        self.decision_seconds.labels(policy)
        self.prefix_match_ratio.labels(policy)
        for kind in ("prompt", "cached_prompt"):
            self.continued_turn_tokens.labels(kind)

    def record_request(self, outcome: str) -> None:
        """Counts one request that ended with ``outcome`` (one of ``OUTCOMES``)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}; expected one of {', '.join(OUTCOMES)}")
        self.requests.labels(self.policy, outcome).inc()

    def record_tenant_request(self, tenant: str, outcome: str) -> None:
        """Counts one request of ``tenant`` by admission ``outcome``."""
        if outcome not in TENANT_OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}; expected one of {', '.join(TENANT_OUTCOMES)}")
        self.tenant_requests.labels(tenant, outcome).inc()

    def record_tenant_tokens(self, tenant: str, prompt: int, completion: int, cached_prompt: int) -> None:
        """Adds one finished request's token counts to ``tenant``'s."""
        for kind, count in (("prompt", prompt), ("completion", completion), ("cached_prompt", cached_prompt)):
            self.tenant_tokens.labels(tenant, kind).inc(max(0, count))

    def record_continued_turn(self, prompt: int, cached_prompt: int) -> None:
        """Counts one finished turn that continued a stored response (its prompt and cached prompt tokens)."""
        self.continued_turn_tokens.labels("prompt").inc(max(0, prompt))
        self.continued_turn_tokens.labels("cached_prompt").inc(max(0, cached_prompt))
        if prompt > 0:
            self.continued_turn_cached_ratio.observe(min(1.0, max(0, cached_prompt) / prompt))

    def record_decision(self, seconds: float, matched_blocks: Optional[int], num_blocks: int) -> None:
        """Records one routing decision and, when known, the chosen replica's prefix match."""
        self.decision_seconds.labels(self.policy).observe(seconds)
        if matched_blocks is not None and num_blocks > 0:
            self.prefix_match_ratio.labels(self.policy).observe(min(1.0, matched_blocks / num_blocks))

    def record_directory_error(self, now: Optional[float] = None) -> None:
        """Counts a failed lookup; the degraded period starts with the first one."""
        now = time.monotonic() if now is None else now
        self.directory_errors.inc()
        if self._degraded_since is None:
            self._degraded_since = now
            self.directory_available.set(0)
        else:  # count the period as it goes, so a long outage shows before it ends
            self.directory_degraded_seconds.inc(now - self._degraded_since)
            self._degraded_since = now

    def record_directory_ok(self, now: Optional[float] = None) -> None:
        """A lookup succeeded: a degraded period (if any) ends and is counted."""
        if self._degraded_since is None:
            return
        now = time.monotonic() if now is None else now
        self.directory_degraded_seconds.inc(now - self._degraded_since)
        self._degraded_since = None
        self.directory_available.set(1)

    def render(self) -> bytes:
        """The router's own series in Prometheus text format."""
        return render_registry(self.registry)


def outcome_of(exc: BaseException) -> str:
    """The ``outcome`` label of a request that ended with ``exc`` (see ``router/backend.py``)."""
    if isinstance(exc, ValueError):
        return "invalid"
    if isinstance(exc, OverloadedError):
        return "overloaded"
    if isinstance(exc, NoReplicaError):
        return "unavailable"
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit, TimeoutError)):
        return "cancelled"  # the client left, or its deadline passed
    return "error"


async def metered(stream: AsyncIterator[StreamChunk], metrics: RouterMetrics) -> AsyncIterator[StreamChunk]:
    """Passes ``stream`` through and counts its outcome once it ends: ``ok`` once a
    chunk with a finish reason went out, else what ended it (``outcome_of``).
    Closing this generator closes ``stream`` (the replica then aborts)."""
    outcome = "error"  # a stream that stops without a finish reason lost its request
    try:
        async for chunk in stream:
            if chunk.finished:
                outcome = "ok"
            yield chunk
    except BaseException as exc:
        if outcome != "ok":
            outcome = outcome_of(exc)
        raise
    finally:
        metrics.record_request(outcome)
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


async def continued_turn(stream: AsyncIterator[StreamChunk], metrics: RouterMetrics) -> AsyncIterator[StreamChunk]:
    """Passes a continued turn's ``stream`` through and counts its prompt and
    cached prompt tokens once its last chunk went out
    (``RouterMetrics.record_continued_turn``). Closing this generator closes ``stream``."""
    try:
        async for chunk in stream:
            if chunk.finished:
                metrics.record_continued_turn(chunk.prompt_tokens, chunk.cached_prompt_tokens)
            yield chunk
    finally:
        aclose = getattr(stream, "aclose", None)
        if aclose is not None:
            await aclose()


_by_key: dict[tuple[str, str], RouterMetrics] = {}
_by_key_lock = threading.Lock()


def get_router_metrics(namespace: str, policy: str) -> RouterMetrics:
    """This process's ``RouterMetrics`` of one cluster (see the module doc for why
    it is process-wide). Thread-safe; the same object for the same arguments."""
    with _by_key_lock:
        metrics = _by_key.get((namespace, policy))
        if metrics is None:
            metrics = _by_key[(namespace, policy)] = RouterMetrics(policy)
        return metrics


class ClusterMetrics:
    """Renders ``GET /metrics``: the router's series, then every live replica's
    when this router is the namespace's metrics exporter.

    With several routers, each replica series must be exported once, or
    ``sum()`` over a replica counter counts it once per router. The routers
    of a namespace share a lease in the directory (``claim_metrics_exporter``):
    the holder renews it at each scrape and exports the replicas' series; the
    others export only their own. When the holder stops (or stops being
    scraped) for ``exporter_ttl_s``, the next router scraped takes over.
    ``prefixserve:router_metrics_exporter`` is 1 on the holder.

    Args:
        router: The router's metrics.
        directory: The prefix directory (``cluster.shared.directory.Directory``) the
            replicas publish to; None renders the router's series only.
        owner: This router's name in the lease (default: host, pid and a random suffix).
        exporter_ttl_s: Lease length; keep it above the scrape interval.
    """

    def __init__(self, router: RouterMetrics, directory: Any = None, owner: Optional[str] = None,
                 exporter_ttl_s: float = DEFAULT_EXPORTER_TTL_S) -> None:
        self.router = router
        self.directory = directory
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.exporter_ttl_s = exporter_ttl_s
        self._warned_no_lease = False

    async def _is_exporter(self) -> bool:
        from cluster.shared.directory import DirectoryAuthError

        try:
            held = await self.directory.claim_metrics_exporter(self.owner, self.exporter_ttl_s)
        except DirectoryAuthError as exc:  # an ACL without the lease key: export, as before leases
            if not self._warned_no_lease:
                logger.warning("/metrics: cannot take the exporter lease (%s); exporting the replicas' series "
                               "from every router", exc)
                self._warned_no_lease = True
            held = True
        self.router.metrics_exporter.set(1 if held else 0)
        return held

    async def release(self) -> None:
        """Gives the exporter lease up (a router stopping), so another takes over at once."""
        if self.directory is None:
            return
        try:
            await self.directory.release_metrics_exporter(self.owner)
        except DirectoryError as exc:
            logger.info("/metrics: the exporter lease was not released (it expires): %s", exc)
        self.router.metrics_exporter.set(0)

    async def render(self) -> bytes:
        """The exposition text of the whole cluster (never raises for Redis trouble)."""
        texts: Mapping[str, Union[bytes, str]] = {}
        if self.directory is not None:
            try:
                if await self._is_exporter():
                    texts = await self.directory.replica_metrics()
            except DirectoryError as exc:
                self.router.record_directory_error()
                logger.warning("/metrics: replicas' series unavailable (directory): %s", exc)
        return self.router.render() + merge_expositions(texts)


def merge_expositions(texts: Mapping[str, Union[bytes, str]]) -> bytes:
    """Merges several exposition texts into one, family by family.

    Concatenating them would repeat ``# HELP`` / ``# TYPE`` lines, which the
    text format forbids. A text that does not parse, or a family whose type
    disagrees with an earlier one, is logged and left out.

    Args:
        texts: ``{source (replica id): exposition text}``.
    """
    families: dict[str, Metric] = {}
    for source, text in sorted(texts.items()):
        raw = text.decode() if isinstance(text, bytes) else text
        try:
            parsed = list(text_string_to_metric_families(raw))
        except ValueError as exc:
            logger.warning("/metrics: the series of %s do not parse, left out: %s", source, exc)
            continue
        for family in parsed:
            merged = families.get(family.name)
            if merged is None:
                families[family.name] = family
            elif merged.type != family.type:
                logger.warning("/metrics: %s is a %s at %s but a %s elsewhere, left out",
                               family.name, family.type, source, merged.type)
            else:
                merged.samples.extend(family.samples)
    return render_families(families.values()) if families else b""
