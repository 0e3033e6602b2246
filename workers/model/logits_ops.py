"""The batched logit transforms of random sampling (``sampler.py``):
repetition / frequency / presence penalties, top-k and top-p. Each works on
``[N, V]`` float32 logits with per-row parameters and leaves rows whose
parameter is neutral unchanged.

Top-k keeps ties with the k-th value, like Hugging Face's
``TopKLogitsWarper``; top-p looks for the nucleus among the most likely
``_TOP_P_CANDIDATES`` tokens first and sorts the whole vocabulary only for
rows whose nucleus is wider.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from workers.engine.outputs import ScheduledRequest


# Top-p looks for the nucleus among this many most likely tokens before
# sorting the whole vocabulary (see apply_top_p).
_TOP_P_CANDIDATES = 256


def _pad(rows: list[Sequence[int]], fill: int, device: torch.device) -> torch.Tensor:
    """[len(rows), max_len] int64 tensor, rows right-padded with ``fill``."""
    width = max(1, max(len(r) for r in rows))
    padded = [list(r) + [fill] * (width - len(r)) for r in rows]
    return torch.tensor(padded, dtype=torch.long, device=device)


def apply_penalties(logits: torch.Tensor, requests: Sequence[ScheduledRequest]) -> torch.Tensor:
    """Applies repetition, frequency and presence penalties (not in place).

    Repetition penalty (CTRL / HF ``RepetitionPenaltyLogitsProcessor``) covers
    tokens seen in the prompt or the output: positive logits are divided by
    it, negative ones multiplied. Frequency and presence penalties (OpenAI)
    cover output tokens: ``logit -= frequency * count + presence * (count > 0)``.
    The repetition penalty is applied first, as in vLLM.

    Args:
        logits: [N, V] float logits, one row per request.
        requests: The N requests, aligned with the rows.

    Returns:
        A new [N, V] tensor (the input is left untouched).
    """
    vocab = logits.shape[1]
    device = logits.device
    params = [r.sampling_params for r in requests]
    # Gather / scatter at the seen ids only (O(tokens), not O(vocab)), as HF
    # does. Ids are right-padded with ``vocab``: a dummy column, dropped at the
    # end. Repeated ids write the same value, so each token is penalized once.
    out = F.pad(logits, (0, 1))
    if any(p.repetition_penalty != 1.0 for p in params):
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
        seen_ids = _pad([[*r.prompt_token_ids, *r.output_token_ids] for r in requests], vocab, device)
        score = out.gather(1, seen_ids)
        out.scatter_(1, seen_ids, torch.where(score < 0, score * penalty, score / penalty))
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        output_ids = _pad([r.output_token_ids for r in requests], vocab, device)
        presence = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
        out.scatter_(1, output_ids, out.gather(1, output_ids) - presence)
        # One subtraction per occurrence: frequency * count.
        frequency = torch.tensor([-p.frequency_penalty for p in params], device=device).unsqueeze(1)
        out.scatter_add_(1, output_ids, frequency.expand_as(output_ids))
    return out[:, :vocab]


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Masks (to -inf) tokens below each row's k-th largest logit.

    Ties with the k-th value stay, like HF's ``TopKLogitsWarper``.

    Args:
        logits: [N, V] temperature-scaled logits.
        top_k: [N] int64, each in [1, V].

    Returns:
        A new masked [N, V] tensor.
    """
    # topk of the largest k only: a full sort of [N, V] costs ~20x more on CPU.
    top_values = logits.topk(int(top_k.max()), dim=-1).values
    kth = top_values.gather(1, (top_k - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Masks (to -inf) tokens outside each row's top-p nucleus.

    A token (in order of decreasing probability) is kept while the mass
    strictly before it is below ``top_p``; the most likely token always stays.
    This is HF's ``TopPLogitsWarper`` rule, written from the top.

    The nucleus of a peaked distribution is small, so it is looked for among
    the ``_TOP_P_CANDIDATES`` most likely tokens first (a topk, normalized by
    the full row's logsumexp); only rows whose candidates hold less than
    ``top_p`` of the mass pay for a full sort. Both give the same kept set.

    Args:
        logits: [N, V] temperature-scaled (maybe top-k masked) logits.
        top_p: [N] float, each in (0, 1).

    Returns:
        A new masked [N, V] tensor.
    """
    num_candidates = min(logits.shape[1], _TOP_P_CANDIDATES)
    values, ids = logits.topk(num_candidates, dim=-1)
    probs = (values - logits.logsumexp(dim=-1, keepdim=True)).exp()
    keep_sorted = probs.cumsum(dim=-1) - probs < top_p.unsqueeze(1)
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ids, keep_sorted)
    out = logits.masked_fill(~keep, float("-inf"))
    # Covered: the first token past the candidates already has mass >= top_p before it.
    uncovered = probs.sum(dim=-1) < top_p
    if bool(uncovered.any()):
        out[uncovered] = _top_p_by_sort(logits[uncovered], top_p[uncovered])
    return out


def _top_p_by_sort(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    sorted_logits.masked_fill_(probs.cumsum(dim=-1) - probs >= top_p.unsqueeze(1), float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)
