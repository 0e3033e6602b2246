"""Structured outputs on the engine side: a grammar state per constrained
sequence, the step's token masks, drafts checked against the grammar, and
jump-forward proposals. Pure Python: the grammar library lives behind the
``GrammarBackend`` / ``GrammarState`` protocols (``workers/structured/``
implements them with xgrammar), so the control plane is tested with fakes.

The state follows the sequence's committed tokens only::

    schedule()        mask rows: the state now, then (with drafts d1..dk) the
                      state after d1, after d1 d2, ... (accept, fill, roll back)
    runner            each sampling row reads its mask (disallowed -> -inf)
    update_from_output  state.accept(token) for every token the sequence keeps

A sequence keeps its output tokens through swap and recompute preemption,
so its state needs nothing there; a migrated stream replays the tokens the
client already has (``GenerationRequest.num_resumed_output_tokens``).

Drafts (n-gram, draft model, Medusa, trees) are trimmed at the first token
the grammar rejects before their slots are allocated: a rejected draft could
never be accepted (its row's parent mask gives it probability 0).

Jump-forward: where the grammar forces the next characters (``{"name": "``
after the opening of an object with fixed keys), ``JumpForwardProposer``
proposes their tokens as drafts. The same step verifies them like any draft,
each row sampled from its own masked distribution, so the output is exactly
masked decoding's: a forced token's row allows only that token, and where the
tokenizer could split the forced text differently the model's own choice
wins and the rest of the draft is dropped.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol
from typing import Sequence as Sequence_


def timeout_message(params: Any, timeout_s: float) -> str:
    """The error of a constraint that did not compile within ``timeout_s``."""
    return (f"compiling structured_outputs.{params.kind} took longer than {timeout_s:g} s "
            "(structured_outputs_config compile_timeout_s): simplify it (fewer nested anyOf / oneOf, "
            "shorter alternatives) or raise the timeout")


class GrammarState(Protocol):
    """One sequence's position in its grammar."""

    def accept(self, token_id: int) -> bool:
        """Advances by one token (mutates); False, and no change, if the grammar rejects it."""

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` accepted tokens (mutates)."""

    def fill_mask(self, masks: Any, row: int) -> None:
        """Writes the tokens allowed next into row ``row`` of ``masks`` (no mutation of the state)."""

    def is_terminated(self) -> bool:
        """Whether the grammar has ended (its stop token accepted)."""

    def jump_forward(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens of the text the grammar forces next, each
        accepted by the grammar in turn; the state is left as it was."""


class GrammarBackend(Protocol):
    """Compiles constraints and makes states and masks."""

    def new_state(self, params: Any, compiled: Any = None) -> GrammarState:
        """A fresh state for ``params`` (a ``StructuredOutputsParams``), from
        ``compiled`` when given, else compiled now (cached).

        Raises:
            ValueError: The constraint does not compile, or not in time.
        """

    def allocate_masks(self, num_rows: int) -> Any:
        """A mask buffer of ``num_rows`` rows for ``fill_mask``."""


def trim_drafts(state: GrammarState, drafts: Sequence_[int], parents: Sequence_[int]
                ) -> tuple[list[int], list[int]]:
    """The drafts the grammar allows on their own path (``parents`` empty: a
    chain, cut at the first rejected token; a tree loses each rejected node
    with its subtree, the order and parents renumbered). The state is left
    as it was."""
    if not drafts:
        return [], []
    if not parents:
        kept = 0
        for token in drafts:
            if not state.accept(token):
                break
            kept += 1
        state.rollback(kept)
        return list(drafts[:kept]), []
    new_index: dict[int, int] = {}
    out_tokens: list[int] = []
    out_parents: list[int] = []
    for j, token in enumerate(drafts):
        parent = parents[j]
        if parent >= 0 and parent not in new_index:
            continue  # its parent was dropped
        path = _path(parents, parent)  # every node on it was kept: the grammar accepts it
        for a in path:
            accepted = state.accept(drafts[a])
            assert accepted, ("a kept draft's path is accepted", drafts[a])
        ok = state.accept(token)
        state.rollback(len(path) + ok)
        if ok:
            new_index[j] = len(out_tokens)
            out_tokens.append(token)
            out_parents.append(new_index[parent] if parent >= 0 else -1)
    if out_parents == list(range(-1, len(out_parents) - 1)):
        out_parents = []
    return out_tokens, out_parents


def _path(parents: Sequence_[int], node: int) -> list[int]:
    """Indices from depth 1 down to ``node`` (empty for -1, the fed token)."""
    path: list[int] = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def fill_draft_masks(state: GrammarState, backend: GrammarBackend, drafts: Sequence_[int],
                     parents: Sequence_[int]) -> Any:
    """Masks of a sampling step: row 0 the state now, row ``1 + j`` the state
    after draft j's path (drafts already trimmed). The state is left as it was."""
    masks = backend.allocate_masks(1 + len(drafts))
    state.fill_mask(masks, 0)
    if not parents:
        for j, token in enumerate(drafts):
            accepted = state.accept(token)
            assert accepted, ("drafts are trimmed before masks are filled", token)
            state.fill_mask(masks, 1 + j)
        state.rollback(len(drafts))
        return masks
    for j in range(len(drafts)):
        path = _path(parents, j)
        for a in path:
            accepted = state.accept(drafts[a])
            assert accepted, ("drafts are trimmed before masks are filled", drafts[a])
        state.fill_mask(masks, 1 + j)
        state.rollback(len(path))
    return masks


class JumpForwardProposer:
    """Proposes the tokens a constrained sequence's grammar forces next, and
    otherwise asks ``fallback`` (the configured speculative proposer, if any).

    Args:
        states: The grammar state of a request id (None: unconstrained).
        limit: Most forced tokens per proposal.
        fallback: The speculative config's proposer; None proposes nothing
            for unconstrained sequences.
    """

    def __init__(self, states: Callable[[str], Optional[GrammarState]], limit: int,
                 fallback: Optional[Any] = None) -> None:
        self._states = states
        self.limit = limit
        self.fallback = fallback
        self.from_runner = bool(getattr(fallback, "from_runner", False))
        self.num_proposed_tokens = 0  # forced tokens proposed so far (metrics)
        if fallback is not None and hasattr(fallback, "propose_many"):
            self.propose_many = self._propose_many
        if fallback is None or hasattr(fallback, "propose_candidates"):
            self.propose_candidates = self._propose_candidates

    def __getattr__(self, name: str) -> Any:
        # The configured proposer's own parts (a draft model's KV pool, ...) stay reachable.
        fallback = self.__dict__.get("fallback")
        if fallback is None:
            raise AttributeError(name)
        return getattr(fallback, name)

    def _forced(self, request_id: str, k: int) -> list[int]:
        state = self._states(request_id)
        if state is None or k <= 0:
            return []
        forced = state.jump_forward(min(k, self.limit))
        self.num_proposed_tokens += len(forced)
        return forced

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        forced = self._forced(request_id, k)
        if forced or self.fallback is None:
            return forced
        return self.fallback.propose(request_id, token_ids, k)

    def _propose_candidates(self, request_id: str, token_ids: list[int], k: int, m: int) -> list[list[int]]:
        forced = self._forced(request_id, k)
        if forced or self.fallback is None:
            return [forced] if forced else []
        return self.fallback.propose_candidates(request_id, token_ids, k, m)

    def _propose_many(self, asks: list[tuple[str, list[int], int]]) -> list[list[int]]:
        out: list[Optional[list[int]]] = [self._forced(rid, k) or None for rid, _, k in asks]
        rest = [i for i, found in enumerate(out) if found is None]
        if rest:
            for i, drafts in zip(rest, self.fallback.propose_many([asks[i] for i in rest])):
                out[i] = list(drafts)
        return [found or [] for found in out]

    def receive(self, request_id: str, num_tokens: int, candidates: list[list[int]]) -> None:
        receive = getattr(self.fallback, "receive", None)
        if receive is not None:
            receive(request_id, num_tokens, candidates)

    def drop(self, request_id: str) -> None:
        if self.fallback is not None:
            self.fallback.drop(request_id)
