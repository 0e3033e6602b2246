"""Plain-text tables and percentiles: what ``status`` and the benchmarks print."""

from __future__ import annotations


def percentile(sorted_values: list[float], pct: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    k = min(len(sorted_values) - 1, max(0, round(pct / 100 * (len(sorted_values) - 1))))
    return sorted_values[k]


def format_table(rows: list[tuple[str, ...]]) -> list[str]:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
