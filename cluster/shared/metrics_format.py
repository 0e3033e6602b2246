"""Prometheus text exposition shared by replicas and routers (no workers, no router).

Both sides name their series ``prefixserve:*`` (``METRIC_PREFIX``) and render
them without prometheus_client's ``*_created`` samples, which the text
format turns into a gauge family each (noise for dashboards and alerts).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric

METRIC_PREFIX = "prefixserve:"


def drop_created(families: Iterable[Metric]) -> Iterator[Metric]:
    """Yields the families without ``*_created`` samples or families (mutates them)."""
    for family in families:
        if family.name.endswith("_created"):
            continue
        family.samples = [s for s in family.samples if not s.name.endswith("_created")]
        yield family


class _Families:
    """A registry-like view of ready families, for ``generate_latest``."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def render_families(families: Iterable[Metric]) -> bytes:
    """Prometheus text format of ``families``, ``*_created`` samples dropped."""
    return generate_latest(_Families(drop_created(families)))  # type: ignore[arg-type]


def render_registry(registry: Any) -> bytes:
    """Prometheus text format of a ``CollectorRegistry``, ``*_created`` samples dropped."""
    return render_families(registry.collect())


def sample_names(registry: Any) -> set[str]:
    """Every family and sample name a registry exports (``*_total``, ``*_bucket``, ...)."""
    names: set[str] = set()
    for family in drop_created(registry.collect()):
        names.add(family.name)
        names.update(s.name for s in family.samples)
    return names
