"""Prometheus series of KV transfers between replicas (``workers/kv_transfer.py``),
in the replica's own registry (``ReplicaMetrics.registry``), with its labels::

    counters    kv_transfer_bytes_total{direction}         in: imported, out: exported
                kv_transfer_blocks_total{direction}
                kv_transfer_prefix_tokens_total            prompt tokens whose KV came by transfer
                kv_transfer_fallbacks_total{reason}        fetches that imported nothing: the
                                                           request prefills instead
                kv_transfer_refused_total                  exports refused (the out limit)
    histogram   kv_transfer_seconds                        a fetch, from asking the holder
                                                           to the blocks being hittable
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cluster.shared.metrics_format import METRIC_PREFIX as PREFIX

TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
FALLBACK_REASONS = ("busy", "error", "timeout", "not_held", "no_room", "mismatch", "unreachable", "no_adapter")


class TransferMetrics:
    """The ``prefixserve:kv_transfer_*`` series of one replica.

    Args:
        registry: The replica's registry (a fresh one when None: tests).
        labels: The replica's ``replica`` and ``model`` label values.
    """

    def __init__(self, registry: Optional[CollectorRegistry] = None,
                 labels: Optional[dict[str, str]] = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = labels or {"replica": "", "model": ""}
        names = tuple(labels)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, (*names, *extra), registry=self.registry)

        self._bytes = counter("kv_transfer_bytes", "KV bytes moved between replicas.", ("direction",))
        self._blocks = counter("kv_transfer_blocks", "KV blocks moved between replicas.", ("direction",))
        self._fallbacks = counter("kv_transfer_fallbacks", "Fetches that imported nothing (the request prefills).",
                                  ("reason",))
        self.prefix_tokens = counter("kv_transfer_prefix_tokens",
                                     "Prompt tokens whose KV was imported from another replica.").labels(**labels)
        self.refused = counter("kv_transfer_refused", "Exports refused at the concurrent-transfer limit."
                               ).labels(**labels)
        self.seconds = Histogram(PREFIX + "kv_transfer_seconds",
                                 "A fetch, from asking the holder to the blocks being hittable here.",
                                 names, buckets=TRANSFER_BUCKETS, registry=self.registry).labels(**labels)
        self._labels = labels
        for direction in ("in", "out"):  # every series present from the start (zeros)
            self._bytes.labels(**labels, direction=direction)
            self._blocks.labels(**labels, direction=direction)
        for reason in FALLBACK_REASONS:
            self._fallbacks.labels(**labels, reason=reason)

    def moved(self, direction: str, num_blocks: int, num_bytes: int) -> None:
        self._blocks.labels(**self._labels, direction=direction).inc(num_blocks)
        self._bytes.labels(**self._labels, direction=direction).inc(num_bytes)

    def fallback(self, reason: str) -> None:
        assert reason in FALLBACK_REASONS, reason
        self._fallbacks.labels(**self._labels, reason=reason).inc()

    def value(self, name: str, **labels: str) -> float:
        """A sample's current value (tests, bench tables); 0 when absent."""
        got = self.registry.get_sample_value(PREFIX + name, {**self._labels, **labels})
        return float(got or 0.0)


class MoveMetrics:
    """The series of a warm start or a hand-over (``workers/kv_warm_start.py``,
    ``workers/kv_handover.py``): ``<name>_total{outcome}`` (every outcome present
    from the start), ``<name>_blocks_total``, ``<name>_bytes_total`` and
    ``<name>_seconds`` (a gauge: the last one). ``docs``: the four help texts."""

    def __init__(self, registry: Any, labels: dict[str, str], name: str, outcomes: Sequence[str],
                 docs: tuple[str, str, str, str]) -> None:
        names = tuple(labels)
        self._outcomes = Counter(PREFIX + name, docs[0], (*names, "outcome"), registry=registry)
        for outcome in outcomes:
            self._outcomes.labels(**labels, outcome=outcome)
        self.blocks = Counter(PREFIX + name + "_blocks", docs[1], names, registry=registry).labels(**labels)
        self.bytes = Counter(PREFIX + name + "_bytes", docs[2], names, registry=registry).labels(**labels)
        self.seconds = Gauge(PREFIX + name + "_seconds", docs[3], names, registry=registry).labels(**labels)
        self._labels = labels

    def record(self, result: Any) -> None:
        """Counts ``result`` (its ``outcome``, ``blocks``, ``bytes`` and ``seconds``)."""
        self._outcomes.labels(**self._labels, outcome=result.outcome).inc()
        self.blocks.inc(result.blocks)
        self.bytes.inc(result.bytes)
        self.seconds.set(result.seconds)
