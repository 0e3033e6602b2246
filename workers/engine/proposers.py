"""Who proposes speculative tokens: the ``Proposer`` protocol, prompt lookup
(n-gram), and the proposer fed by the runner (Medusa heads, a draft model
run in the runner). The ``Speculator`` (``spec_decode.py``) decides how many
of their tokens a step verifies."""

from __future__ import annotations

from typing import Protocol


class Proposer(Protocol):
    """Proposes up to ``k`` tokens to follow ``token_ids`` (maybe none). A
    proposer that batches its work (a draft model) also has ``propose_many``,
    taking ``[(request_id, token_ids, k)]`` and returning the drafts in order."""

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]: ...

    def drop(self, request_id: str) -> None: ...


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of
    the sequence's last n tokens (n from ``prompt_lookup_max`` down to
    ``prompt_lookup_min``), in the prompt or the output; for a tree, the
    distinct continuations of the latest few occurrences, longest n first.

    Each request keeps an index, per n, from n-gram to the positions after
    its latest ``KEEP`` occurrences, grown by the tokens added since the last
    call, so a step costs O(new tokens), not O(sequence).
    """

    KEEP = 4  # occurrences remembered per n-gram (most recent last)

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._index: dict[str, tuple[list[dict[tuple[int, ...], list[int]]], list[int]]] = {}

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        found = self.propose_candidates(request_id, token_ids, k, 1)
        return found[0] if found else []

    def propose_candidates(self, request_id: str, token_ids: list[int], k: int, m: int) -> list[list[int]]:
        """Up to ``m`` distinct continuations of up to ``k`` tokens, the latest
        occurrence of the longest matching n-gram first."""
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tables, done = self._index.setdefault(
            request_id, ([{} for _ in range(self.max_n - self.min_n + 1)], [0]))
        end = len(token_ids)
        # n-grams ending at e (exclusive) with a token after them: e <= end - 1.
        for e in range(max(done[0], self.min_n), end):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                seen = tables[n - self.min_n].setdefault(tuple(token_ids[e - n : e]), [])
                seen.append(e)
                if len(seen) > self.KEEP:
                    del seen[0]
        done[0] = end
        found: list[list[int]] = []
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            for after in reversed(tables[n - self.min_n].get(tuple(token_ids[end - n :]), ())):
                candidate = token_ids[after : after + k]
                if candidate and candidate not in found:
                    found.append(candidate)
                    if len(found) == m:
                        return found
        return found

    def drop(self, request_id: str) -> None:
        self._index.pop(request_id, None)


class RunnerProposer:
    """Proposals the model runner made at the end of the previous step (Medusa
    heads on the last hidden state: ``workers/model/medusa.py``), handed to
    the scheduler with that step's output. A proposal is used only if the
    sequence still has the length it was made for."""

    from_runner = True

    def __init__(self) -> None:
        self._made: dict[str, tuple[int, list[list[int]]]] = {}

    def receive(self, request_id: str, num_tokens: int, candidates: list[list[int]]) -> None:
        self._made[request_id] = (num_tokens, [list(c) for c in candidates])

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        found = self.propose_candidates(request_id, token_ids, k, 1)
        return found[0] if found else []

    def propose_candidates(self, request_id: str, token_ids: list[int], k: int, m: int) -> list[list[int]]:
        made = self._made.pop(request_id, None)
        if made is None or made[0] != len(token_ids):
            return []
        return [c[:k] for c in made[1][:m] if c[:k]]

    def drop(self, request_id: str) -> None:
        self._made.pop(request_id, None)
