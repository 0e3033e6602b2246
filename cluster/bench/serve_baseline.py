"""The cluster against the engine alone, for ``bench serve --engine-baseline``.

The machine's speed drifts 10-40% from minute to minute, so a ratio of two
figures measured minutes apart is mostly drift. The engine alone
(``engine_baseline.py``) runs before and after each run of the cluster, and
each run's ratios are taken against the mean of the two runs around it.
With ``--rounds N`` the cluster runs N times, each on a freshly started
local cluster, alternated with N + 1 runs of the engine alone::

    engine, cluster, engine, cluster, engine, ...  (round r: cluster r against engines r and r + 1)

and the table shows the median round's ratio with the range over rounds.
"""

from __future__ import annotations

import statistics
from typing import Any, Optional, Sequence

RATIOS = ("itl_p50_over_step", "ttft_p50_over_prefill_and_step", "output_throughput_over_engine")


def engine_run(engine_args: dict[str, Any], conversations: Sequence[Any],
               max_concurrency: Optional[int]) -> dict[str, float]:
    """One run of the engine alone on the dataset's first turns (a child process)."""
    from cluster.bench import engine_baseline

    prompts = [c.turns[0].new_token_ids for c in conversations]
    return engine_baseline.measure(engine_args, prompts, [c.turns[0].output_len for c in conversations],
                                   max_concurrency)


def against_baseline(summary: dict[str, Any], baselines: Sequence[dict[str, float]]) -> dict[str, Any]:
    """The engine's figures (the mean of the runs around the cluster's) and
    the cluster's against them: median ITL over the batch-1 step, median
    TTFT over prefill plus one step, output tokens/s over the engine's."""
    out = _engine_figures(baselines)
    out.update({
        "itl_p50_over_step": summary["itl_ms"]["p50"] / out["step_ms"],
        "ttft_p50_over_prefill_and_step": summary["ttft_ms"]["p50"] / (out["prefill_ms"] + out["step_ms"]),
        "output_throughput_over_engine": summary["output_throughput"] / out["output_throughput"],
    })
    return out


def _engine_figures(baselines: Sequence[dict[str, float]]) -> dict[str, Any]:
    """The engine alone's figures: the mean of ``baselines``."""
    def mean(key: str) -> float:
        return statistics.fmean(b[key] for b in baselines)

    return {"step_ms": mean("step_ms"), "prefill_ms": mean("prefill_ms"),
            "output_throughput": mean("output_throughput"), "max_num_seqs": baselines[0]["max_num_seqs"],
            "runs": list(baselines)}


def against_rounds(summaries: Sequence[dict[str, Any]], baselines: Sequence[dict[str, float]]) -> dict[str, Any]:
    """Each round's ratios (``summaries[r]`` against ``baselines[r]`` and
    ``baselines[r + 1]``), and per ratio the median round's with the range.

    Raises:
        ValueError: There is not one more baseline run than rounds.
    """
    if len(baselines) != len(summaries) + 1:
        raise ValueError(f"{len(summaries)} rounds need {len(summaries) + 1} runs of the engine alone, "
                         f"got {len(baselines)}")
    rounds = [against_baseline(s, baselines[r:r + 2]) for r, s in enumerate(summaries)]
    out = _engine_figures(baselines)  # every run's mean
    out["rounds"] = [{key: r[key] for key in RATIOS} for r in rounds]
    for key in RATIOS:
        values = [r[key] for r in rounds]
        out[key] = statistics.median(values)
        out[key + "_range"] = [min(values), max(values)]
    return out


def ratio_text(base: dict[str, Any], key: str) -> str:
    """``1.05x``, or with rounds ``1.05x [0.98-1.12] (3 rounds)``."""
    text = f"{base[key]:.2f}x"
    if len(base.get("rounds", ())) > 1:
        low, high = base[key + "_range"]
        text += f" [{low:.2f}-{high:.2f}] ({len(base['rounds'])} rounds)"
    return text
