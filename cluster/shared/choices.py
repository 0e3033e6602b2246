"""Several choices of one request (``SamplingParams.n`` / ``best_of``): what
each choice samples with, and how ``best_of`` picks the returned ones. Shared
by the engine (which forks the choices), the offline API and the router
(which continues choices after a migration and selects the best)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from cluster.shared.types import SamplingParams


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """What choice ``index`` samples with: one sequence, its own seed (``seed + index``,
    as vLLM derives them), prompt logprobs with choice 0 only."""
    if params.num_choices == 1:
        return params
    seed = params.seed + index if params.seed is not None else None
    return dataclasses.replace(params, n=1, best_of=None, seed=seed,
                               prompt_logprobs=params.prompt_logprobs if index == 0 else None)


def ranking_params(params: SamplingParams) -> SamplingParams:
    """``params`` as generated: with ``best_of`` > n the choices are ranked on their
    logprobs, so they are computed even when not asked for (and dropped after)."""
    if params.best_of is not None and params.best_of > params.n and params.logprobs is None:
        return dataclasses.replace(params, logprobs=0)
    return params


def select_best(scores: Sequence[float], n: int) -> list[int]:
    """Indices of the ``n`` highest ``scores`` (cumulative logprobs), best first;
    ties keep the lower index (OpenAI's ``best_of``)."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:n]
