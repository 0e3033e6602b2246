"""EAGLE-2's dynamic draft trees (Li et al., 2024, "EAGLE-2: Faster
Inference of Language Models with Dynamic Draft Trees"), for
``speculative_config={"method": "eagle", "num_candidates": m}``.

The draft's confidence (its log-probability of a token, summed along the
path: an estimate of the path's acceptance) decides where the tree grows::

    depth 1   the m likeliest first guesses                      (m nodes)
    depth r   each of the m frontier nodes runs one draft row (its token, its
              parent's feature, attending the sequence's context and its own
              path), proposes its m likeliest children; of those m * m, the m
              with the highest path score are the next frontier
    result    the m paths to the last frontier, best score first: the beam's m
              likeliest continuations of the full depth, which the scheduler
              merges into one tree (they share their common prefixes)

So the tree is deep where the draft is sure and wide where it hesitates,
instead of a fixed shape. The scheduler merges the candidates into one tree
(``Speculator.build_tree``): adaptive speculation keeps another candidate's
nodes only while they pay (its measured branch rate and step cost), and the
step's room caps the nodes (the node budget); the target verifies them with
the tree attention every tree uses (``spec_trees.py``), so tokens never change.

Every sequence of a step expands at once: m rows per sequence per depth, each
attending the sequence's caught-up draft keys and values (``_context``) and
the keys of its own path, which stay beside the step (never written to the
draft's cache). Ties between equal scores go to the lower index (``topk``).
"""

from __future__ import annotations

from typing import Any

import torch


def expand_trees(proposer: Any, group: list[dict], features: torch.Tensor,
                 context: tuple[torch.Tensor, torch.Tensor, torch.Tensor], width: int, depth: int
                 ) -> list[list[list[int]]]:
    """Candidate continuations per sequence of ``group`` (module doc).

    Args:
        proposer: The ``EagleProposer`` (its draft, embedding, LM head).
        group: The asking sequences (``positions``: their caught-up rows).
        features: ``[B, H]``: each sequence's last caught-up feature.
        context: ``(keys, values, lengths)`` of the sequences' draft cache.
        width: Nodes kept per depth (``num_candidates``).
        depth: Tree depth (the most proposals any sequence asks for).

    Returns:
        Per sequence, ``width`` candidates of ``depth`` tokens, best score first.
    """
    draft, dev = proposer.draft, proposer.device
    b = len(group)
    logp = torch.log_softmax(proposer.lm_head(features).float(), dim=-1)
    scores, index = logp.topk(width, dim=-1)  # [B, W]
    tokens = _ids(proposer, index)
    # Per sequence: nodes as (token, parent node or -1, score), depth-1 nodes first.
    nodes: list[list[tuple[int, int, float]]] = [[(t, -1, s) for t, s in zip(tr, sr)]
                                                for tr, sr in zip(tokens.tolist(), scores.tolist())]
    frontier = [list(range(width)) for _ in range(b)]  # node ids of the frontier, per sequence
    if depth > 1:
        keys, values, lengths = context
        rep = lambda t: t.repeat_interleave(width, dim=0)  # noqa: E731 (one row per frontier node)
        keys, values, lengths = rep(keys), rep(values), rep(lengths)
        width_ctx = keys.shape[1]
        feats = rep(features)
        base = rep(torch.tensor([s["positions"][-1] for s in group], device=dev))
        flat_tokens, flat_scores = tokens.reshape(-1), scores.reshape(-1)
        for r in range(1, depth):
            x, q, k, v = draft.qkv(proposer.embed(flat_tokens).to(proposer.dtype), feats, base + r)
            keys = torch.cat([keys, k.unsqueeze(1)], dim=1)
            values = torch.cat([values, v.unsqueeze(1)], dim=1)
            span = torch.arange(keys.shape[1], device=dev)
            mask = ((span[None, :] < lengths[:, None]) | (span[None, :] >= width_ctx)).unsqueeze(1)
            out = draft.finish(x, draft.attend(q.unsqueeze(1), keys, values, mask)[:, 0])
            child_logp = torch.log_softmax(proposer.lm_head(out).float(), dim=-1)
            child_scores, child_index = child_logp.topk(width, dim=-1)  # [B*W, W]
            total = (flat_scores[:, None] + child_scores).view(b, width * width)
            best, pick = total.topk(width, dim=-1)  # [B, W]: child j of frontier row j // W
            parent_rows = (pick // width) + torch.arange(b, device=dev)[:, None] * width  # rows of [B*W]
            child_tokens = _ids(proposer, child_index.view(b, width * width).gather(1, pick))
            rows = parent_rows.reshape(-1)
            keys, values, feats = keys.index_select(0, rows), values.index_select(0, rows), out.index_select(0, rows)
            flat_tokens, flat_scores = child_tokens.reshape(-1), best.reshape(-1)
            for seq in range(b):
                parents = [frontier[seq][p] for p in (pick[seq] // width).tolist()]
                start = len(nodes[seq])
                nodes[seq].extend((t, p, s) for t, p, s in zip(child_tokens[seq].tolist(), parents,
                                                                 best[seq].tolist()))
                frontier[seq] = list(range(start, start + width))
    return [_candidates(n, f) for n, f in zip(nodes, frontier)]


def _ids(proposer: Any, index: torch.Tensor) -> torch.Tensor:
    return index if proposer.token_ids is None else proposer.token_ids[index]


def _candidates(nodes: list[tuple[int, int, float]], frontier: list[int]) -> list[list[int]]:
    """The token paths to the frontier's nodes, best score first."""
    leaves = sorted(frontier, key=lambda j: -nodes[j][2])
    out = []
    for j in leaves:
        path = []
        while j >= 0:
            path.append(nodes[j][0])
            j = nodes[j][1]
        out.append(path[::-1])
    return out
