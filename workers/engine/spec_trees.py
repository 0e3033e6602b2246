"""Speculation trees: how a step's proposals hang together and which of them
its samples accepted.

Trees (SpecInfer; ``num_candidates`` > 1): the proposer offers several
candidate continuations (the n-gram lookup's distinct continuations of
earlier matches, the Medusa heads' likeliest combinations of their top
tokens); they are merged into a tree of distinct tokens per parent, laid out
depth-first with the likeliest candidate first, and every node is one more
decode row, attending its own path (``AttentionMetadata.tree_tails``)::

    fed token -> a -> b -> c          input [last, a, b, c, x, y]
              `-> x -> y              slots  c+1 .. c+5 in that order

The sequence keeps the path its own samples walk (from the fed token's
sample, each sample picking the child with that token), so exactness is the
chain's argument per node. An accepted node whose slot is not its position
(``x`` above sits at c+4, belongs at c+1) is moved there by the next step
(``SchedulerOutput.kv_moves``), before anything reads it.

A chain is the tree whose every proposal's parent is the one before it
(``parents`` empty).
"""

from __future__ import annotations

from typing import Sequence as Sequence_


def accepted_path(drafts: Sequence_[int], parents: Sequence_[int], sampled: Sequence_[int]
                  ) -> tuple[list[int], int, tuple[int, int]]:
    """Walks a verified step's proposals (a chain when ``parents`` is empty)
    with its samples: from the fed token, each sample takes the child with
    its token. Returns the accepted proposals' indices by depth, the depth
    the samples reached (accepted, plus one where the walk ended at a node
    with children), and ``(branch trials, branch hits)``: nodes with several
    children where the first child's token was not sampled, and how many of
    those sampled another child's."""
    parents = list(parents) or list(range(-1, len(drafts) - 1))
    kids: dict[int, list[int]] = {}
    for j, parent in enumerate(parents):
        kids.setdefault(parent, []).append(j)
    node, path, trials, hits = -1, [], 0, 0
    for token in sampled:
        children = kids.get(node)
        if not children:
            break
        nxt = next((c for c in children if drafts[c] == token), None)
        if len(children) > 1 and drafts[children[0]] != token:
            trials += 1
            hits += nxt is not None
        if nxt is None:
            return path, len(path) + 1, (trials, hits)
        path.append(nxt)
        node = nxt
    return path, len(path), (trials, hits)


def tree_paths(parents: Sequence_[int], num_drafts: int) -> list[list[int]]:
    """Each proposal's path from depth 1 down to itself (proposal indices);
    ``parents`` empty is a chain of ``num_drafts``."""
    paths: list[list[int]] = []
    for j, parent in enumerate(parents or range(-1, num_drafts - 1)):
        assert -1 <= parent < j, ("a proposal's parent must come before it", list(parents))
        paths.append((paths[parent] if parent >= 0 else []) + [j])
    return paths


def tree_depth(parents: Sequence_[int], num_drafts: int) -> int:
    """How deep a step's proposals go: ``num_drafts`` for a chain (``parents``
    empty), else the longest path of the tree."""
    return max(map(len, tree_paths(parents, num_drafts)), default=0) if parents else num_drafts
