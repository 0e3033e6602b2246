"""Figures of ``prefixserve bench serve`` from per-request records.

Definitions follow ``vllm bench serve``:

    TTFT      send -> first output token
    TPOT      (E2E - TTFT) / (output tokens - 1), per request with > 1 token
    ITL       gaps between consecutive streamed chunks, over all requests
    E2E       send -> last chunk
    goodput   requests/s that meet every SLO of --goodput (ttft, tpot, e2el, in ms)

plus, from the servers' ``Usage``: prefix hit rate = cached prompt tokens /
prompt tokens, and for datasets with a shared system prompt the hit rate over
that part alone (``min(cached, shared_prefix_len) / shared_prefix_len``), and
for multi-turn datasets the continued-turn hit rate: cached / prompt tokens
over the turns after each conversation's first (the router's
``router_continued_turn_cached_ratio`` for ``previous_response_id`` turns).
Percentiles are nearest-rank (``cluster.client.table.percentile``), as in every
benchmark here.

Structured-output datasets add, over the requests that carried a constraint:
``structured_requests`` (sent), ``structured_stop`` and ``structured_length``
(finished with ``stop`` / ``length``: a truncated answer is not judged),
``structured_valid`` (stop-finished answers the dataset's validator accepts)
and ``structured_valid_share`` = valid / stop-finished (None when none
stopped), plus a few invalid answers to read.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from cluster.client.table import format_table, percentile

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 95, 99)
INVALID_EXAMPLES = 3  # invalid structured answers the JSON shows, each cut to EXAMPLE_CHARS
EXAMPLE_CHARS = 200


@dataclass
class RequestRecord:
    """What the client saw of one request (times in seconds, from the run's start).

    Attributes:
        conversation, turn: Where the request sits in the dataset.
        prompt_len: Prompt tokens sent.
        output_len: Output tokens asked for.
        shared_prefix_len: Leading tokens shared with other requests of its group.
        sent_at: When it was sent.
        ttft: Send -> first token (None if no token came).
        latency: Send -> last chunk.
        itl: Gaps between consecutive chunks that carried tokens.
        token_times: (time, tokens) of each chunk that carried tokens.
        prompt_tokens, completion_tokens, cached_prompt_tokens: The server's Usage.
        replica_id: Replica that served it, when the transport says.
        error: Why it failed; empty when it succeeded.
        finish_reason: ``stop``, ``length`` or ``abort``, when the transport says.
        structured: It carried an output constraint.
        structured_valid: Whether its answer validated; None when not judged
            (unconstrained, failed, or not finished with ``stop``).
        output_text: The whole answer, kept for constrained requests only.
    """

    conversation: int
    turn: int
    prompt_len: int
    output_len: int
    shared_prefix_len: int = 0
    sent_at: float = 0.0
    ttft: Optional[float] = None
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    token_times: list[tuple[float, int]] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    replica_id: str = ""
    error: str = ""
    finish_reason: str = ""
    structured: bool = False
    structured_valid: Optional[bool] = None
    output_text: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def tpot(self) -> Optional[float]:
        if self.ttft is None or self.completion_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.completion_tokens - 1)


def parse_goodput(items: Optional[Sequence[str]]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 0.5, "tpot": 0.05}`` (seconds).

    Raises:
        ValueError: An item is not ``NAME:MS`` with NAME in ttft, tpot, e2el and MS >= 0.
    """
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not sep or name not in GOODPUT_METRICS or not ms >= 0:
            raise ValueError(f"--goodput takes NAME:MS with NAME in {', '.join(GOODPUT_METRICS)} and MS >= 0 "
                             f"milliseconds, e.g. --goodput ttft:500 tpot:50; got {item!r}")
        slos[name] = ms / 1000.0
    return slos


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """Whether a finished request meets every SLO (a missing figure fails it)."""
    values = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.latency}
    for name, limit in slos.items():
        value = values[name]
        if name == "tpot" and value is None and record.completion_tokens == 1:
            continue  # one token: no time per output token to judge
        if value is None or value > limit:
            return False
    return True


def distribution(values: Sequence[float]) -> dict[str, float]:
    """``{"mean", "p50", "p95", "p99"}`` in the values' unit (zeros when empty)."""
    if not values:
        return {"mean": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    data = sorted(values)
    return {"mean": statistics.fmean(data), **{f"p{p}": percentile(data, p) for p in PERCENTILES}}


def summarize(records: Sequence[RequestRecord], duration: float,
              slos: Optional[dict[str, float]] = None, structured: bool = False) -> dict[str, Any]:
    """The run's figures (JSON-ready; latencies in milliseconds).

    Args:
        records: One per request sent.
        duration: The run's seconds.
        slos: Goodput SLOs in seconds (``parse_goodput``).
        structured: Report the structured-output counters even when no
            request carried a constraint (they do whenever one did).
    """
    done = [r for r in records if r.ok]
    duration = max(duration, 1e-9)
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_prompt_tokens for r in done)
    output = sum(r.completion_tokens for r in done)
    shared = [r for r in done if r.shared_prefix_len > 0]
    shared_total = sum(r.shared_prefix_len for r in shared)
    per_replica: dict[str, int] = {}
    for r in done:
        if r.replica_id:
            per_replica[r.replica_id] = per_replica.get(r.replica_id, 0) + 1

    def ms(values: list[float]) -> dict[str, float]:
        return {k: round(v * 1000.0, 3) for k, v in distribution(values).items()}

    out: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": round(duration, 3),
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "total_cached_prompt_tokens": cached,
        "request_throughput": round(len(done) / duration, 4),
        "input_throughput": round(prompt / duration, 2),
        "output_throughput": round(output / duration, 2),
        "prefix_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "ttft_ms": ms([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": ms([t for t in (r.tpot for r in done) if t is not None]),
        "itl_ms": ms([gap for r in done for gap in r.itl]),
        "e2el_ms": ms([r.latency for r in done]),
        "requests_per_replica": dict(sorted(per_replica.items())),
    }
    if shared_total:
        hit = sum(min(r.cached_prompt_tokens, r.shared_prefix_len) for r in shared)
        out["shared_prefix_hit_rate"] = round(hit / shared_total, 4)
    continued = [r for r in done if r.turn > 0]
    if continued:
        continued_prompt = sum(r.prompt_tokens for r in continued)
        out["continued_turns"] = len(continued)
        out["continued_turn_hit_rate"] = round(
            sum(r.cached_prompt_tokens for r in continued) / continued_prompt, 4) if continued_prompt else 0.0
    if slos:
        good = sum(1 for r in done if meets_slos(r, slos))
        out["goodput"] = {"slos_ms": {k: v * 1000.0 for k, v in slos.items()}, "good_requests": good,
                          "request_goodput": round(good / duration, 4)}
    if structured or any(r.structured for r in records):
        out.update(structured_counts(records))
    errors = sorted({r.error for r in records if r.error})
    if errors:
        out["errors"] = errors[:10]
    return out


def structured_counts(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """The structured-output counters of the module doc."""
    constrained = [r for r in records if r.structured]
    stopped = [r for r in constrained if r.ok and r.finish_reason == "stop"]
    valid = sum(1 for r in stopped if r.structured_valid)
    out: dict[str, Any] = {
        "structured_requests": len(constrained),
        "structured_stop": len(stopped),
        "structured_length": sum(1 for r in constrained if r.ok and r.finish_reason == "length"),
        "structured_valid": valid,
        "structured_valid_share": round(valid / len(stopped), 4) if stopped else None,
    }
    invalid = [r.output_text[:EXAMPLE_CHARS] for r in stopped if not r.structured_valid]
    if invalid:
        out["structured_invalid_examples"] = invalid[:INVALID_EXAMPLES]
    return out


def format_summary(title: str, summary: dict[str, Any]) -> list[str]:
    """The table ``bench serve`` prints (a vLLM-like block)."""
    lines = [f"============ {title} ============"]
    rows = [
        ("Successful requests:", str(summary["completed"])),
        ("Failed requests:", str(summary["failed"])),
        ("Benchmark duration (s):", f"{summary['duration_s']:.2f}"),
        ("Total input tokens:", str(summary["total_input_tokens"])),
        ("Total generated tokens:", str(summary["total_output_tokens"])),
        ("Request throughput (req/s):", f"{summary['request_throughput']:.2f}"),
        ("Input token throughput (tok/s):", f"{summary['input_throughput']:.1f}"),
        ("Output token throughput (tok/s):", f"{summary['output_throughput']:.1f}"),
        ("Prefix cache hit rate:", f"{summary['prefix_hit_rate']:.1%}"),
    ]
    if "shared_prefix_hit_rate" in summary:
        rows.append(("System-prompt hit rate:", f"{summary['shared_prefix_hit_rate']:.1%}"))
    if "continued_turn_hit_rate" in summary:
        rows.append((f"Continued-turn hit rate ({summary['continued_turns']} turns):",
                     f"{summary['continued_turn_hit_rate']:.1%}"))
    if "goodput" in summary:
        slos = " ".join(f"{k}<={v:g}ms" for k, v in summary["goodput"]["slos_ms"].items())
        rows.append((f"Request goodput (req/s, {slos}):", f"{summary['goodput']['request_goodput']:.2f}"))
    if "structured_requests" in summary:
        rows += _structured_rows(summary)
    if summary["requests_per_replica"]:
        rows.append(("Requests per replica:", " ".join(map(str, summary["requests_per_replica"].values()))))
    lines += format_table(rows)
    header = ("latency (ms)", "mean", "p50", "p95", "p99")
    table = [header]
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E")):
        d = summary[key]
        table.append((label, *(f"{d[k]:.1f}" for k in ("mean", "p50", "p95", "p99"))))
    lines += format_table(table)
    if "engine_baseline" in summary:
        lines += format_table(_baseline_rows(summary["engine_baseline"]))
    if summary.get("ttft_split"):
        from cluster.bench.ttft_split import rows as split_rows

        lines += format_table(split_rows(summary["ttft_split"]))
    if summary.get("kv_transfers"):
        kv = summary["kv_transfers"]
        fallbacks = " ".join(f"{k} {v}" for k, v in kv["fallbacks"].items()) or "0"
        lines += format_table([("KV fetches (prefix tokens, MB in, mean ms):",
                                f"{kv['fetches']} ({kv['prefix_tokens_fetched']}, {kv['mb_in']:.1f}, "
                                f"{kv['fetch_ms_mean']:.0f})"), ("KV fetch fallbacks:", fallbacks)])
    return lines


def _baseline_rows(base: dict[str, Any]) -> list[tuple[str, str]]:
    from cluster.bench.serve_baseline import ratio_text

    return [
        ("Engine alone, batch-1 step (ms):", f"{base['step_ms']:.1f}"),
        ("Engine alone, prefill of the prompt (ms):", f"{base['prefill_ms']:.1f}"),
        (f"Engine alone, output tok/s (max_num_seqs {base['max_num_seqs']}):", f"{base['output_throughput']:.1f}"),
        ("ITL p50 / engine step:", ratio_text(base, "itl_p50_over_step")),
        ("TTFT p50 / (prefill + step):", ratio_text(base, "ttft_p50_over_prefill_and_step")),
        ("Output tok/s / engine's:", ratio_text(base, "output_throughput_over_engine")),
    ]


def _structured_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    share = summary["structured_valid_share"]
    valid = f"{summary['structured_valid']} / {summary['structured_stop']}"
    return [
        ("Constrained requests:", str(summary["structured_requests"])),
        ("Valid outputs (of stop finishes):", valid + (f" ({share:.1%})" if share is not None else " (-)")),
        ("Constrained length finishes:", str(summary["structured_length"])),
    ]


def tokens_per_second_series(records: Sequence[RequestRecord], bin_s: float = 1.0) -> tuple[list[float], list[float]]:
    """Output tokens/s in ``bin_s`` bins from the run's start: (bin starts, rates)."""
    times = [(t, n) for r in records for t, n in r.token_times]
    if not times:
        return [], []
    num_bins = int(max(t for t, _ in times) // bin_s) + 1
    counts = [0] * num_bins
    for t, n in times:
        counts[int(t // bin_s)] += n
    return [i * bin_s for i in range(num_bins)], [c / bin_s for c in counts]


def series_bin_seconds(duration: float, max_bins: int = 60) -> float:
    """The smallest round bin width that cuts ``duration`` into at most ``max_bins`` bins."""
    for width in (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0):
        if duration / width <= max_bins:
            return width
    return duration / max_bins


def plot(path: str, runs: Sequence[tuple[str, Sequence[RequestRecord]]], title: str) -> None:
    """Latency CDFs (TTFT, TPOT, E2E) and output tokens/s over time, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = (
        (axes[0][0], "TTFT", lambda r: [x.ttft for x in r if x.ok and x.ttft is not None]),
        (axes[0][1], "TPOT", lambda r: [t for t in (x.tpot for x in r if x.ok) if t is not None]),
        (axes[1][0], "end-to-end latency", lambda r: [x.latency for x in r if x.ok]),
    )
    for ax, label, pick in panels:
        # Milliseconds for short latencies, seconds once they pass 10 s.
        longest = max((v for _, records in runs for v in pick(records)), default=0.0)
        unit, scale = ("s", 1.0) if longest > 10.0 else ("ms", 1000.0)
        for name, records in runs:
            data = sorted(v * scale for v in pick(records))
            if data:
                ax.step(data, [(i + 1) / len(data) for i in range(len(data))], where="post", label=name)
        ax.set_xlabel(f"{label} ({unit})")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    ax = axes[1][1]
    bin_s = series_bin_seconds(max((t for _, r in runs for x in r for t, _ in x.token_times), default=0.0))
    for name, records in runs:
        starts, rates = tokens_per_second_series(records, bin_s)
        if starts:  # close the last bin so a one-bin run still draws a line
            ax.step(starts + [starts[-1] + bin_s], rates + [rates[-1]], where="post", label=name)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel(f"output tokens/s ({bin_s:g} s bins)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
