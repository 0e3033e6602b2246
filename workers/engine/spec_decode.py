"""Speculative decoding on the engine side: who proposes tokens, how many, and
what came of them.

Pure Python, like the scheduler. One step of a decoding sequence with
speculation (k = 3 proposed tokens ``d1 d2 d3``)::

    scheduler   input [last, d1, d2, d3]       one slot each in the KV cache
    runner      4 rows, each a decode of its own position (same kernels as
                without speculation), sampled as if d1.. were already output:
                t0 t1 t2 t3
                accept d1 if t0 == d1, then d2 if t1 == d2, ...; the sequence
                gets the accepted drafts and the first token that disagrees
                (or t3, the bonus token, when all three were accepted)
    scheduler   num_computed_tokens += tokens kept; blocks past the sequence
                freed (the rejected slots' KV is never read: attention stops at
                the sequence's length, and the next step overwrites it)

Why this is exact: row j is sampled from the target's distribution given the
prompt, the output and ``d1..dj`` (every sampling parameter applied as without
speculation, a seeded request drawing row j's noise for output position
``len(output) + j``). Accepting ``d`` when the target's own draw equals it is
rejection sampling for a proposer that puts all its mass on ``d``: accepted
with probability ``p(d) = min(1, p(d) / 1)``, and on rejection the draw is
distributed as ``norm(max(0, p - onehot(d)))``. Greedy and seeded requests get
the very tokens they would get without speculation.

Trees (SpecInfer; ``num_candidates`` > 1): several candidate continuations
merged into a tree, verified in one step and walked by the samples
(``spec_trees.py``).

How many to propose (``Speculator.depth_limit``): a draft at depth i is
accepted with probability ``alpha ** i`` (``alpha``: the request's measured
acceptance rate) and costs ``b`` seconds, the measured price of a verified
draft token (``StepCostModel``: step time against the step's own tokens and
its draft tokens). A draft is proposed while its expected tokens per second
beat the plain step's: ``alpha ** i / b > sequences / plain step time``.
Where proposals fail (random text) acceptance falls and nothing is proposed;
where the step is compute-bound (large batches) the slope rises and nothing
is proposed either. A node of another candidate, branching off at depth e,
is worth ``alpha ** (e - 1) * (1 - alpha) * beta`` (times ``alpha`` per
depth below), ``beta`` the measured rate at which another candidate's token
was taken where the likeliest one's was not, and is proposed by the same
rule.

A request whose drafts stopped paying proposes nothing, so nothing would
measure its acceptance again: text that turns predictable later (a quote, a
list, a structured tail) would never be drafted. So it probes: every
``PROBE_EVERY`` tokens it drafts one token (one verified row in that many
steps, ~0.1-0.3% of the steps' time), and the probes' outcomes move its rate
(and the rate over all requests, a new request's prior) as any draft's do.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Optional

from cluster.shared.config import SpeculativeConfig
from workers.engine.proposers import NgramProposer, Proposer
from workers.engine.spec_cost import StepCostModel

logger = logging.getLogger(__name__)


@dataclass
class SpecStats:
    """Cumulative counts (vLLM's spec-decode metrics)."""

    num_drafts: int = 0  # steps of a sequence that proposed at least one token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    proposed_per_position: list[int] = field(default_factory=list)
    # Trees: nodes with several children where the first child's token was rejected, and how
    # many of those took another child's (another candidate won).
    num_branch_trials: int = 0
    num_branch_hits: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a drafting step produced, on average (accepted drafts + 1)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length}


class Speculator:
    """Proposals per sequence and step, sized to what pays (see the module doc).

    Args:
        config: ``method``, ``num_speculative_tokens``, the proposer's knobs,
            ``adaptive`` (False: always propose up to ``num_speculative_tokens``).
        proposer: Overrides the one ``config.method`` names (tests).
    """

    PRIOR_ACCEPTANCE = 0.5  # the first requests' acceptance rate, worth PRIOR_WEIGHT trials
    PRIOR_WEIGHT = 2.0
    PRIOR_BRANCH = 0.3  # prior rate at which another candidate's token is taken where the first's is not
    DECAY = 0.9  # weight of a request's past (prior included) per step that proposed
    GLOBAL_DECAY = 0.995  # the same for the rate over all requests, a new request's prior
    PROBE_EVERY = 32  # a request proposing nothing drafts one token when its length is a multiple of this

    def __init__(self, config: SpeculativeConfig, proposer: Optional[Proposer] = None) -> None:
        self.config = config
        self.k_max = config.num_speculative_tokens
        self.adaptive = config.adaptive
        self.proposer: Proposer = proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        # The runner proposes (Medusa): it is asked, per sampling request, for this many guesses.
        self.from_runner = bool(getattr(self.proposer, "from_runner", False))
        # Trees: several candidates per sequence, when the proposer offers them.
        self.num_candidates = config.num_candidates if hasattr(self.proposer, "propose_candidates") else 1
        self.cost = StepCostModel()
        self.stats = SpecStats(accepted_per_position=[0] * self.k_max, proposed_per_position=[0] * self.k_max)
        self._trials: dict[str, tuple[float, float]] = {}  # request -> (accepted, trials), decayed
        self._global = (self.PRIOR_ACCEPTANCE * self.PRIOR_WEIGHT, self.PRIOR_WEIGHT)  # all requests, decayed
        self._last_step: tuple[int, int] = (1, 1)  # (tokens, sequences that sampled) of the last step
        # Where a tree's first candidate was rejected at a node with others: (times another was taken, times), decayed.
        self._branch = (self.PRIOR_BRANCH * self.PRIOR_WEIGHT, self.PRIOR_WEIGHT)
        # Runner proposers: (guesses asked, drafts verified), decayed; prior one guess per draft.
        self._guesses = (self.PRIOR_WEIGHT, self.PRIOR_WEIGHT)

    # ---------------------------------------------------------------- proposing
    def acceptance(self, request_id: str) -> float:
        """The request's acceptance rate: accepted / reached draft positions,
        past steps decayed, starting from a prior that decays with them."""
        accepted, trials = self._trials.get(request_id, self._prior())
        return accepted / trials

    def _prior(self) -> tuple[float, float]:
        """A new request starts from the recent rate over all requests (what
        this proposer achieves on this traffic), worth PRIOR_WEIGHT trials."""
        accepted, trials = self._global
        return accepted / trials * self.PRIOR_WEIGHT, self.PRIOR_WEIGHT

    def _threshold(self) -> Optional[float]:
        """The expected accepted tokens a draft token must bring to pay for
        its verification (None: not adaptive, or nothing measured yet)."""
        if not self.adaptive:
            return None
        fit = self.cost.fit()
        if fit is None:
            return None
        base, a, b = fit
        tokens, seqs = self._last_step
        plain_step = base + a * tokens  # the step without drafts
        if b <= 0.0 or plain_step <= 0.0:
            return None
        # A runner proposer's draft costs the guess it was (the heads' pass, a step earlier) and then its
        # verified row: both are units of the cost model, so a draft costs b * (1 + guesses per draft).
        guesses, drafts = self._guesses
        per_draft = b * (1.0 + guesses / drafts) if self.from_runner else b
        # A draft pays when its expected tokens per per_draft seconds beat the plain step's seqs tokens per
        # plain_step.
        return per_draft * seqs / plain_step

    def depth_limit(self, request_id: str, num_tokens: Optional[int] = None) -> int:
        """How many drafts pay for this request now (0 to ``num_speculative_tokens``);
        with its length ``num_tokens``, at least 1 on a probe (module doc)."""
        threshold = self._threshold()
        if threshold is None:
            return self.k_max
        alpha = self.acceptance(request_id)
        depth, gain = 0, 1.0
        while depth < self.k_max:
            gain *= alpha
            if gain <= threshold:
                break
            depth += 1
        if depth == 0 and num_tokens is not None and num_tokens % self.PROBE_EVERY == 0 and self.k_max:
            return 1
        return depth

    @property
    def branch_rate(self) -> float:
        """How often another candidate's token was taken where the first candidate's was not."""
        hits, trials = self._branch
        return hits / trials

    def build_tree(self, request_id: str, candidates: list[list[int]], depth: int, room: int
                   ) -> tuple[list[int], list[int]]:
        """Merges candidate continuations (likeliest first) into a tree:
        ``(tokens, parents)`` depth-first, the first candidate's chain first
        (indices 0..), at most ``depth`` deep and ``room`` nodes; ``parents``
        is empty when the result is a chain. Adaptive: another candidate's
        nodes are kept while they pay (module doc)."""
        threshold = self._threshold()
        alpha = self.acceptance(request_id)
        beta = self.branch_rate
        kids: list[dict[int, int]] = [{}]  # trie node 0: the fed token; node j + 1: tokens[j] in insertion order
        tokens: list[int] = []
        parent_of: list[int] = []
        for rank, candidate in enumerate(candidates):
            node, worth, branched = 0, 1.0, False
            for e, token in enumerate(candidate[:depth], start=1):
                nxt = kids[node].get(token)
                if nxt is None:
                    if rank and threshold is not None:  # worth of another candidate's node (module doc)
                        worth = worth * alpha if branched else alpha ** (e - 1) * (1.0 - alpha) * beta
                        branched = True
                        if worth <= threshold:
                            break
                    kids.append({})
                    tokens.append(token)
                    parent_of.append(node - 1)
                    nxt = kids[node][token] = len(tokens)
                node = nxt
        # Depth-first order (children in insertion order), at most `room` nodes.
        order: list[int] = []
        stack = list(reversed(list(kids[0].values())))
        while stack and len(order) < room:
            j = stack.pop()
            order.append(j)
            stack.extend(reversed(list(kids[j].values())))
        index = {j: i for i, j in enumerate(order)}
        out_tokens = [tokens[j - 1] for j in order]
        parents = [index[parent_of[j - 1] + 1] if parent_of[j - 1] >= 0 else -1 for j in order]
        if parents == list(range(-1, len(parents) - 1)):
            parents = []
        return out_tokens, parents

    def propose_batch(self, requests: list[tuple]) -> list[tuple[list[int], list[int]]]:
        """Drafts for decoding sequences ``(request_id, token_ids, room[, slots])``,
        each at most ``room`` deep (what its max_tokens, max_model_len and the
        step's budget leave) and a tree at most ``slots`` tokens (default
        ``room``): ``(tokens, parents)``, ``parents`` empty for a chain
        (``build_tree``). A batching proposer (a draft model) runs them at
        once."""
        # A runner proposer's guesses were asked a step earlier (runner_proposals_wanted): no probes.
        probe = not self.from_runner
        asks = [(r[0], r[1], min(self.depth_limit(r[0], len(r[1]) if probe else None), r[2])) for r in requests]
        wanted = [i for i, (_, _, k) in enumerate(asks) if k > 0]
        out: list[tuple[list[int], list[int]]] = [([], []) for _ in requests]
        if not wanted:
            return out
        if self.num_candidates > 1:
            for i in wanted:
                rid, tokens, k = asks[i]
                candidates = self.proposer.propose_candidates(rid, tokens, k, self.num_candidates)
                out[i] = self.build_tree(rid, candidates, k, requests[i][-1])
            return out
        many = getattr(self.proposer, "propose_many", None)
        if many is not None:
            drafts = many([asks[i] for i in wanted])
        else:
            drafts = [self.proposer.propose(*asks[i]) for i in wanted]
        for i, draft in zip(wanted, drafts):
            out[i] = (list(draft[: asks[i][2]]), [])
        return out

    def runner_proposals_wanted(self, request_id: str) -> int:
        """Guesses to ask the runner for (0 unless it is the proposer)."""
        return self.depth_limit(request_id) if self.from_runner else 0

    def receive(self, request_id: str, num_tokens: int, candidates: list[list[int]]) -> None:
        """The runner's guesses (candidate continuations, likeliest first) for a
        sequence that now has ``num_tokens`` tokens."""
        receive = getattr(self.proposer, "receive", None)
        if receive is not None:
            receive(request_id, num_tokens, candidates)

    # ---------------------------------------------------------------- learning
    def observe_step(self, num_tokens: int, num_draft_tokens: int, num_sampling_seqs: int, seconds: float,
                     num_guesses: int = 0) -> None:
        """One executed step: its own tokens, the draft tokens it verified
        (with the runner's guesses for the next step, ``num_guesses`` of
        them, which the cost model prices alike), the sequences that sampled,
        and its duration."""
        self.cost.observe(num_tokens, num_draft_tokens, seconds)
        self._last_step = (max(1, num_tokens), max(1, num_sampling_seqs))
        if self.from_runner and num_draft_tokens:
            guesses, drafts = self._guesses
            decay = self.GLOBAL_DECAY
            self._guesses = (guesses * decay + num_guesses, drafts * decay + num_draft_tokens - num_guesses)

    def observe_result(self, request_id: str, num_proposed: int, num_accepted: int,
                       num_nodes: Optional[int] = None, branches: tuple[int, int] = (0, 0),
                       reached: Optional[int] = None) -> None:
        """How a step's drafts fared for one sequence: ``num_proposed`` their
        depth (a chain's length, a tree's longest path: the positions counted
        as proposed), ``num_accepted`` accepted; ``num_nodes`` the tree's size
        (default ``num_proposed``); ``branches``: (times the first candidate's
        token was rejected at a node with others, times another was taken);
        ``reached``: the depth the samples could reach (in a tree, the
        accepted nodes and one more where the walk ended at a node with
        children; default ``num_proposed``), which the acceptance rate counts
        as trials."""
        if num_proposed <= 0:
            return
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_nodes if num_nodes is not None else num_proposed
        stats.num_accepted_tokens += num_accepted
        stats.num_branch_trials += branches[0]
        stats.num_branch_hits += branches[1]
        if branches[0]:
            hits, trials = self._branch
            self._branch = (hits * self.GLOBAL_DECAY + branches[1], trials * self.GLOBAL_DECAY + branches[0])
        for i in range(num_proposed):
            stats.proposed_per_position[i] += 1
            if i < num_accepted:
                stats.accepted_per_position[i] += 1
        trials = num_accepted + (1 if num_accepted < (reached if reached is not None else num_proposed) else 0)
        accepted, seen = self._trials.get(request_id, self._prior())
        self._trials[request_id] = (accepted * self.DECAY + num_accepted, seen * self.DECAY + trials)
        accepted, seen = self._global
        self._global = (accepted * self.GLOBAL_DECAY + num_accepted, seen * self.GLOBAL_DECAY + trials)

    def drop(self, request_id: str) -> None:
        """Forgets a finished request."""
        self._trials.pop(request_id, None)
        self.proposer.drop(request_id)
