"""Continuous batching with chunked prefill, prefix reuse and preemption.

Each ``schedule()`` fills a token budget (``max_num_batched_tokens``) and at
most ``max_num_seqs`` sequences, in this order (vLLM v1 style)::

    1. running    decodes first, then unfinished prefill chunks, each by
                  (priority, arrival). Out of blocks: preempt the running
                  sequence with the largest (priority, arrival) -- swap it
                  to CPU, or free it for recompute -- and retry.
    2. swapped    resumed before any new request, by (priority, arrival)
    3. waiting    by (priority, arrival), prefix-cache hits first skipped
    Steps 2 and 3 run only if nothing was preempted in step 1, and stop at
    the first sequence that does not fit (no overtaking).

A waiting sequence whose next uncached block is being prefilled by a running
sequence (two requests of one tenant arriving together) waits for that
prefill instead of computing the same blocks beside it: one step later they
are in the prefix cache and it starts from there (SGLang's in-batch prefix
caching). Admission stops there too, so the order is kept.

Chunked prefill is "num_computed_tokens catches up with num_tokens": a
sequence gets ``min(uncomputed tokens, budget left)`` tokens this step, and
samples only when the chunk reaches its last known token (budget 16, a
40-token prompt next to one decoding sequence)::

    step 1   decode 1 | prompt  0..14  (15, no sample)
    step 2   decode 1 | prompt 15..29  (15, no sample)
    step 3   decode 1 | prompt 30..39  (10, samples its first token)

With ``enable_chunked_prefill`` off a prompt is admitted only whole. The one
exception is a sequence preempted for recompute whose prompt + output has
outgrown the budget: it is chunked, else it could never run again.

The scheduler advances ``num_computed_tokens`` in ``update_from_output``,
after the runner computed the step. One ``schedule()`` must be followed by
its ``update_from_output`` (even when the output is empty: sequences that
could never fit are reported there) before the next ``schedule()``.

Parallel sampling (``n`` / ``best_of``): a request forks into its choices
in the step that samples its first token; the choices share the prompt's KV
and every one holds a ``max_num_seqs`` slot from admission on
(``forks.py``).

The queues and their order live in ``request_queue.py``; what a request must
be to run here, in ``validation.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional
from typing import Sequence as Sequence_

from cluster.shared.config import SchedulerConfig
from cluster.shared.types import FinishReason
from workers.engine.forks import StepResult, fork_choices, slots_taken
from workers.engine.kv_manager import KVCacheManager
from workers.engine.outputs import ModelOutput, ScheduledRequest, SchedulerOutput
from workers.engine.request_queue import RequestQueue
from workers.engine.sequence import Sequence, SequenceStatus
from workers.engine.spec_decode import Speculator, accepted_path, tree_depth
from workers.engine.structured import GrammarBackend, fill_draft_masks, trim_drafts
from workers.engine.validation import Capacity, fit_problem


STATS_EXACT_WAITING = 32  # waiting sequences whose cached prefix the stats look up


@dataclass
class _StepPlan:
    """What one ``schedule()`` call has decided so far."""

    budget: int
    scheduled: dict[Sequence, int] = field(default_factory=dict)  # seq -> tokens, in order
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    num_preempted: int = 0
    # Speculated tokens of decodes, and their parents (empty: a chain; spec_decode.py).
    drafts: dict[Sequence, tuple[list[int], list[int]]] = field(default_factory=dict)


class Scheduler:
    """Decides, step by step, which tokens of which sequences to compute.

    Args:
        scheduler_config: Batching knobs (read once here).
        kv_manager: Block tables over the device (and swap) pools.
        max_model_len: Longest prompt + output; reaching it ends a sequence.
        eos_token_ids: Tokens that end a sequence unless ``ignore_eos``.
        sliding_window: When every layer attends only to this many last
            positions, blocks outside the window are released after each step.
        speculator: Proposes tokens for decoding sequences, verified by the
            runner in the same step (``spec_decode.py``); None: one token per step.
        structured: Makes the token masks of sequences with a grammar
            (``structured.py``); None where the engine has no grammar backend.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        kv_manager: KVCacheManager,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        sliding_window: Optional[int] = None,
        speculator: Optional[Speculator] = None,
        structured: Optional[GrammarBackend] = None,
    ) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (one prompt token, one output), got {max_model_len}")
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.preemption_mode = scheduler_config.preemption_mode
        self.kv_manager = kv_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self._sorted_eos = tuple(sorted(self.eos_token_ids))  # what min_tokens bans
        self.sliding_window = sliding_window
        self.speculator = speculator
        self.structured = structured

        self.queue = RequestQueue()
        self._finished_ids: set[str] = set()  # since the last schedule()
        self._finished_in_schedule: list[Sequence] = []  # reported by update_from_output
        self._kv_moves: list[tuple[int, int]] = []  # accepted tree branches to move, in the next step
        self.num_preemptions_total = 0

    # ---------------------------------------------------------------- figures
    @property
    def num_running(self) -> int:
        return len(self.queue.running)

    @property
    def num_waiting(self) -> int:
        return len(self.queue.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.queue.swapped)

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens of waiting and running sequences whose KV is not computed
        yet: the prefill work queued here. A waiting sequence's leading blocks
        that are in the prefix cache, or that a running prefill is computing,
        do not count (it will start from them); past the first
        ``STATS_EXACT_WAITING`` waiting sequences the whole prompt counts."""
        total = sum(max(0, seq.num_prompt_tokens - seq.num_computed_tokens) for seq in self.queue.running)
        size = self.kv_manager.block_size
        in_flight = self._blocks_in_prefill() if self.queue.waiting and self.kv_manager.enable_prefix_caching else None
        for i, seq in enumerate(self.queue.waiting):
            reusable = 0
            if in_flight is not None and i < STATS_EXACT_WAITING:
                _, reusable = self.kv_manager.get_computed_blocks(seq)
                while reusable // size < len(seq.block_hashes) and seq.block_hashes[reusable // size] in in_flight:
                    reusable += size
            total += max(0, seq.num_prompt_tokens - max(seq.num_computed_tokens, reusable))
        return total

    @property
    def num_decode_tokens(self) -> int:
        """Context tokens of the running sequences past their prompt (the
        tokens each decode step's attention reads)."""
        return sum(seq.num_tokens for seq in self.queue.running if seq.num_computed_tokens >= seq.num_prompt_tokens)

    def has_unfinished_requests(self) -> bool:
        return bool(len(self.queue))

    def get_request(self, request_id: str) -> Optional[Sequence]:
        """The unfinished sequence with this id, or None. No mutation."""
        return self.queue.get(request_id)

    @property
    def capacity(self) -> Capacity:
        """What bounds a request here (``validation.fit_problem``)."""
        kv = self.kv_manager
        return Capacity(max_model_len=self.max_model_len, max_num_batched_tokens=self.max_num_batched_tokens,
                        enable_chunked_prefill=self.enable_chunked_prefill, block_size=kv.block_size,
                        num_device_blocks=kv.num_device_blocks, sliding_window=self.sliding_window)

    # --------------------------------------------------------------- requests
    def check_request_fits(self, num_prompt_tokens: int, max_tokens: int) -> Optional[str]:
        """Says what to change if a request can never run here, else None. No mutation."""
        return fit_problem(num_prompt_tokens, max_tokens, self.capacity)

    def add_request(self, seq: Sequence) -> None:
        """Queues a new waiting sequence (mutates). The caller has checked
        ``check_request_fits``; a sequence that outgrows the cache anyway
        ends with ``finish_message`` set instead of blocking the queue.

        Raises:
            ValueError: The request id is already in use.
        """
        self.queue.add(seq)

    def finish_request(self, request_id: str, reason: FinishReason) -> bool:
        """Ends a request wherever it is and frees its blocks (mutates). For
        stop strings (found by the engine) and aborts.

        Returns:
            False if no unfinished request has this id.
        """
        seq = self.queue.get(request_id)
        if seq is None:
            return False
        self._finish(seq, reason)
        return True

    def abort_request(self, request_id: str) -> bool:
        """``finish_request(request_id, ABORT)``: waiting, running or swapped."""
        return self.finish_request(request_id, FinishReason.ABORT)

    def _finish(self, seq: Sequence, reason: FinishReason, message: Optional[str] = None) -> None:
        if self.speculator is not None:
            self.speculator.drop(seq.request_id)
        self.kv_manager.free(seq)
        self.queue.remove(seq, reason, message)
        self._finished_ids.add(seq.request_id)

    # --------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        """Picks this step's work (mutates queues, block tables, swap pools).

        Returns:
            The plain-data step for the runner.
        """
        self.kv_manager.release_swap_in_sources()  # the runner has finished the last step
        plan = _StepPlan(budget=self.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.num_preempted:
            self._schedule_swapped(plan)
            self._schedule_waiting(plan)
        out = SchedulerOutput(
            scheduled=[self._make_scheduled(seq, n, plan.drafts.get(seq, ((), ())))
                       for seq, n in plan.scheduled.items()],
            swap_out=plan.swap_out,
            swap_in=plan.swap_in,
            finished_request_ids=self._finished_ids,
            kv_moves=self._kv_moves,
        )
        self._finished_ids = set()
        self._kv_moves = []
        return out

    def _schedule_running(self, plan: _StepPlan) -> None:
        order = sorted(self.queue.running, key=lambda s: (s.num_uncomputed_tokens > 1, self.queue.key(s)))
        proposals = self._propose(order, plan.budget)
        decodes_left = sum(1 for s in order if s.num_uncomputed_tokens == 1)
        for seq in order:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if plan.budget == 0:
                break
            num_new = min(seq.num_uncomputed_tokens, plan.budget)
            assert num_new > 0, seq
            drafts: list[int] = []
            if num_new == seq.num_uncomputed_tokens == 1:
                decodes_left -= 1  # drafts never take the token of a decode still to come
                drafts, parents = proposals.get(seq, ([], []))
                cut = max(0, plan.budget - 1 - decodes_left)  # a tree is depth-first: any cut keeps it whole
                drafts, parents = drafts[:cut], parents[:cut]
            if drafts and self.kv_manager.allocate_slots(seq, 1 + len(drafts)) is not None:
                plan.drafts[seq] = (drafts, parents)
                num_new += len(drafts)
            elif not self._allocate_or_preempt(seq, num_new, plan):
                continue
            plan.scheduled[seq] = num_new
            plan.budget -= num_new

    def _propose(self, order: list[Sequence], budget: int) -> dict[Sequence, tuple[list[int], list[int]]]:
        """Speculated tokens for the decoding sequences (in one batch): none
        without a speculator, and never past a sequence's max_tokens or
        max_model_len, or the step's budget (the target's own token is always
        one more)."""
        if self.speculator is None:
            return {}
        asks = []
        for seq in order:
            if seq.num_uncomputed_tokens != 1:
                continue
            slots = min(self.max_model_len - seq.num_tokens - 1, budget - 1)  # a tree's tokens, every branch
            room = min(seq.sampling_params.max_tokens - seq.num_output_tokens - 1, slots)  # tokens it may keep
            if room > 0:
                asks.append((seq, room, slots))
        if not asks:
            return {}
        drafts = self.speculator.propose_batch([(seq.request_id, seq.all_token_ids, room, slots)
                                                for seq, room, slots in asks])
        out = {}
        for (seq, _, _), d in zip(asks, drafts):
            if d[0] and seq.grammar is not None:  # a draft the grammar rejects could never be accepted
                d = trim_drafts(seq.grammar, *d)
            if d[0]:
                out[seq] = d
        return out

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, plan: _StepPlan) -> bool:
        """Allocates ``num_new`` slots for a running ``seq``, preempting the
        lowest-priority running sequences (maybe ``seq`` itself) until they
        fit. Returns whether ``seq`` is still scheduled."""
        while self.kv_manager.allocate_slots(seq, num_new) is None:
            if self._never_fits(seq.num_computed_tokens + num_new):
                self._finish_for_capacity(seq)
                return False
            victim = max(self.queue.running, key=self.queue.key)
            if victim in plan.scheduled:
                plan.budget += plan.scheduled.pop(victim)
                plan.drafts.pop(victim, None)
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, plan: _StepPlan) -> None:
        """Swaps ``seq`` out, or frees it for recompute when swapping is off
        or the swap pool is full; its generated tokens are kept."""
        self.queue.running.remove(seq)
        self.num_preemptions_total += 1
        seq.num_preemptions += 1
        plan.num_preempted += 1
        if self.preemption_mode == "swap":
            mapping = self.kv_manager.swap_out(seq)
            if mapping is not None:
                plan.swap_out.extend(mapping)
                self.queue.requeue(seq, SequenceStatus.SWAPPED)
                return
        self.kv_manager.free(seq)
        seq.num_computed_tokens = 0
        self.queue.requeue(seq, SequenceStatus.WAITING)

    def _has_slots_for(self, seq: Sequence) -> bool:
        return slots_taken(self.queue) + 1 + len(seq.pending_forks) <= self.max_num_seqs

    def _schedule_swapped(self, plan: _StepPlan) -> None:
        swapped = self.queue.swapped
        while swapped and plan.budget > 0 and self._has_slots_for(swapped[0]):
            seq = swapped[0]
            if self._never_fits(seq.num_tokens):
                self._finish_for_capacity(seq)
                continue
            num_new = self._chunk_size(seq, seq.num_computed_tokens, plan.budget)
            if num_new == 0:
                break
            mapping = self.kv_manager.swap_in(seq, num_new)
            if mapping is None:
                break
            swapped.pop(0)
            plan.swap_in.extend(mapping)
            self._start_running(seq, num_new, plan)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        waiting = self.queue.waiting
        in_flight: Optional[set[bytes]] = None
        while waiting and plan.budget > 0 and self._has_slots_for(waiting[0]):
            seq = waiting[0]
            if self._never_fits(seq.num_tokens):
                self._finish_for_capacity(seq)
                continue
            if seq.sampling_params.prompt_logprobs is None:
                hit_blocks, num_hit_tokens = self.kv_manager.get_computed_blocks(seq)
                if self.kv_manager.enable_prefix_caching:
                    in_flight = self._blocks_in_prefill() if in_flight is None else in_flight
                    next_block = num_hit_tokens // self.kv_manager.block_size
                    if next_block < len(seq.block_hashes) and seq.block_hashes[next_block] in in_flight:
                        break  # a running prefill computes it: start from the cache next step
            else:  # every prompt token is computed for its logprob
                hit_blocks, num_hit_tokens = [], 0
            num_new = self._chunk_size(seq, num_hit_tokens, plan.budget)
            if num_new == 0:
                break
            if self.kv_manager.allocate_slots(seq, num_new, hit_blocks) is None:
                break
            waiting.pop(0)
            seq.num_computed_tokens = num_hit_tokens
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_hit_tokens
            self._start_running(seq, num_new, plan)
            if in_flight is not None:  # its blocks are in prefill from now on
                in_flight.update(seq.block_hashes[num_hit_tokens // self.kv_manager.block_size:])

    def _blocks_in_prefill(self) -> set[bytes]:
        """Hashes of the full prompt blocks running sequences have not computed yet."""
        size = self.kv_manager.block_size
        return {h for r in self.queue.running if r.num_computed_tokens < len(r.block_hashes) * size
                for h in r.block_hashes[r.num_computed_tokens // size:]}

    def _start_running(self, seq: Sequence, num_new: int, plan: _StepPlan) -> None:
        seq.status = SequenceStatus.RUNNING
        self.queue.running.append(seq)
        plan.scheduled[seq] = num_new
        plan.budget -= num_new

    def _chunk_size(self, seq: Sequence, num_computed: int, budget: int) -> int:
        """Tokens to admit ``seq`` with this step; 0 means wait for a step
        with more budget (a whole prompt is due and chunking is off)."""
        remaining = seq.num_tokens - num_computed
        if remaining <= budget:
            return remaining
        if self.enable_chunked_prefill or remaining > self.max_num_batched_tokens:
            return budget
        return 0

    def _never_fits(self, num_tokens: int) -> bool:
        return self.kv_manager.num_blocks_for(num_tokens) > self.kv_manager.num_device_blocks

    def _finish_for_capacity(self, seq: Sequence) -> None:
        """Ends a sequence the whole device cache cannot hold (else it would
        be preempted and readmitted forever)."""
        needed = self.kv_manager.num_blocks_for(seq.num_tokens)
        message = (
            f"request {seq.request_id!r} needs {needed} KV blocks of {self.kv_manager.block_size} tokens "
            f"but the cache holds {self.kv_manager.num_device_blocks}: lower max_tokens or raise "
            f"num_kv_blocks / kv_cache_memory"
        )
        reason = FinishReason.LENGTH if seq.num_output_tokens else FinishReason.ABORT
        self._finish(seq, reason, message)
        self._finished_in_schedule.append(seq)

    def _make_scheduled(self, seq: Sequence, num_new: int,
                        spec: tuple[Sequence_[int], Sequence_[int]] = ((), ())) -> ScheduledRequest:
        drafts, parents = spec
        start = seq.num_computed_tokens
        num_known = num_new - len(drafts)  # tokens of the sequence; the drafts follow
        samples = start + num_known == seq.num_tokens
        guesses = self.speculator.runner_proposals_wanted(seq.request_id) if samples and self.speculator else 0
        masks = None
        if samples and seq.grammar is not None:
            assert self.structured is not None, "a sequence with a grammar needs the engine's grammar backend"
            masks = fill_draft_masks(seq.grammar, self.structured, drafts, parents)
        return ScheduledRequest(
            request_id=seq.request_id,
            input_token_ids=seq.all_token_ids[start : start + num_known] + list(drafts),
            num_computed_tokens=start,
            block_ids=list(seq.block_ids),
            num_sample_tokens=1 + len(drafts) if samples else 0,
            sampling_params=seq.sampling_params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            spec_token_ids=list(drafts),
            spec_parents=list(parents),
            num_proposals=guesses,
            num_proposal_candidates=self.speculator.num_candidates if guesses else 1,
            grammar_bitmask=masks,
            fork_params=tuple(p for _, p, _ in seq.pending_forks) if samples else (),
            min_tokens_banned_ids=self._min_tokens_banned(seq) if samples else (),
        )

    def _min_tokens_banned(self, seq: Sequence) -> tuple[int, ...]:
        params = seq.sampling_params
        if seq.num_output_tokens >= params.min_tokens:
            return ()
        eos = () if params.ignore_eos else self._sorted_eos
        return eos + params.stop_token_ids

    # ------------------------------------------------------------------ update
    def update_from_output(self, sched_out: SchedulerOutput, model_out: ModelOutput) -> list[StepResult]:
        """Applies a computed step (mutates sequences, queues and the cache).

        Advances ``num_computed_tokens``, caches newly full blocks, appends
        sampled tokens and applies token-level stops, freeing finished
        sequences. Requests aborted during the step are skipped.

        Returns:
            ``(seq, new_token_ids, new_logprobs)`` for every sequence that got
            tokens or finished; ``seq.finish_reason`` is set when it ended
            (including sequences ``schedule()`` ended for lack of KV space,
            with ``seq.finish_message`` saying why).
        """
        assert len(model_out.sampled_token_ids) == len(sched_out.scheduled)
        results: list[StepResult] = [(seq, [], None) for seq in self._finished_in_schedule]
        self._finished_in_schedule = []
        for i, req in enumerate(sched_out.scheduled):
            seq = self.queue.get(req.request_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # finished or aborted while the step ran
            assert seq.num_computed_tokens == req.num_computed_tokens, (seq, req)
            if req.spec_token_ids:
                results.append(self._apply_verified(seq, req, model_out, i))
                continue
            seq.num_computed_tokens += req.num_input_tokens
            if model_out.prompt_logprobs is not None and model_out.prompt_logprobs[i] is not None:
                first, entries = model_out.prompt_logprobs[i]
                if seq.prompt_logprobs is None:
                    seq.prompt_logprobs = [None] * len(seq.prompt_token_ids)
                seq.prompt_logprobs[first : first + len(entries)] = entries  # a recompute writes the same places
            self.kv_manager.cache_computed_blocks(seq)
            if self.sliding_window is not None:
                self.kv_manager.release_outside_window(seq, self.sliding_window)
            sampled = model_out.sampled_token_ids[i]
            assert len(sampled) == req.num_sample_tokens, (req.request_id, sampled)
            if not sampled:
                continue
            forks = []
            if req.fork_params:
                assert model_out.fork_samples is not None and model_out.fork_samples[i] is not None, req.request_id
                forks, moves = fork_choices(seq, model_out.fork_samples[i], self.kv_manager, self.queue,
                                            self._check_stop)
                self._kv_moves.extend(moves)
            new_ids = self._append_tokens(seq, sampled)
            self._receive_proposals(seq, model_out, i)
            logprobs = model_out.logprobs[i] if i < len(model_out.logprobs) else None
            results.append((seq, new_ids, logprobs[: len(new_ids)] if logprobs is not None else None))
            results.extend(forks)
        return results

    def _apply_verified(self, seq: Sequence, req: ScheduledRequest, model_out: ModelOutput, i: int) -> StepResult:
        """A decode with speculated tokens: the runner returned the accepted ones
        and the target's next token. Their KV (the fed token's and the accepted
        drafts') is kept, the rejected slots' blocks are freed."""
        sampled = model_out.sampled_token_ids[i]
        num_drafts = len(req.spec_token_ids)
        assert 1 <= len(sampled) <= 1 + num_drafts, (req.request_id, sampled)
        path, reached, branches = accepted_path(req.spec_token_ids, req.spec_parents, sampled)
        assert len(path) == len(sampled) - 1, (req.request_id, sampled, path)
        if self.speculator is not None:
            self.speculator.observe_result(seq.request_id, tree_depth(req.spec_parents, num_drafts), len(sampled) - 1,
                                           num_drafts, branches, reached=reached)
        kept, reason = [], None
        for token_id in sampled:
            seq.append_token(token_id)
            kept.append(token_id)
            reason = self._check_stop(seq, token_id)
            if reason is not None:
                break
        # KV is valid for the fed token and every kept token but the last; an
        # accepted tree node away from its position moves there next step.
        start, bs, table = req.num_computed_tokens + 1, self.kv_manager.block_size, seq.block_ids
        for depth, node in enumerate(path[: len(kept) - 1]):
            if node != depth:
                src, dst = start + node, start + depth
                self._kv_moves.append((table[src // bs] * bs + src % bs, table[dst // bs] * bs + dst % bs))
        seq.num_computed_tokens += len(kept)
        self.kv_manager.cache_computed_blocks(seq)
        if reason is not None:
            self._finish(seq, reason)
        else:
            self._receive_proposals(seq, model_out, i)
            self.kv_manager.trim(seq)
            if self.sliding_window is not None:
                self.kv_manager.release_outside_window(seq, self.sliding_window)
        logprobs = model_out.logprobs[i] if i < len(model_out.logprobs) else None
        return seq, kept, logprobs[: len(kept)] if logprobs is not None else None

    def _receive_proposals(self, seq: Sequence, model_out: ModelOutput, i: int) -> None:
        """Hands the runner's guesses for ``seq``'s next step to the speculator."""
        guesses = model_out.spec_proposals[i] if model_out.spec_proposals is not None else None
        if guesses and self.speculator is not None and not seq.is_finished:
            self.speculator.receive(seq.request_id, seq.num_tokens, guesses)

    def _append_tokens(self, seq: Sequence, token_ids: list[int]) -> list[int]:
        kept = []
        for token_id in token_ids:
            seq.append_token(token_id)
            kept.append(token_id)
            reason = self._check_stop(seq, token_id)
            if reason is not None:
                self._finish(seq, reason)
                break
        return kept

    def _check_stop(self, seq: Sequence, token_id: int) -> Optional[FinishReason]:
        """Why ``seq`` ends after appending ``token_id`` (None: it goes on);
        a sequence with a grammar advances it by the token first."""
        params = seq.sampling_params
        if seq.grammar is not None and not seq.grammar.accept(token_id):
            # The masks make this unreachable; a sequence is never continued outside its grammar.
            seq.finish_message = (f"request {seq.request_id!r}: token {token_id} is outside its "
                                  "structured-output grammar; the output so far is returned")
            return FinishReason.ABORT
        if seq.num_output_tokens > params.min_tokens:  # min_tokens: the sampler banned them before
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return FinishReason.STOP
            if token_id in params.stop_token_ids:
                return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    # --------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Asserts queue, status and block-table invariants. No mutation."""
        kv = self.kv_manager
        kv.check_integrity(list(self.queue))
        self.queue.check_integrity(self.max_num_seqs)
        for seq in self.queue.waiting:
            assert not seq.block_ids and not seq.cpu_block_ids and seq.num_computed_tokens == 0, seq
        for seq in self.queue.running:
            assert not seq.cpu_block_ids, seq
            assert 0 < seq.num_uncomputed_tokens and len(seq.block_ids) >= kv.num_blocks_for(seq.num_computed_tokens)
            assert seq.num_released_blocks < max(1, len(seq.block_ids)), seq
        for seq in self.queue.swapped:
            assert not seq.block_ids and not seq.num_released_blocks, seq
            assert len(seq.cpu_block_ids) == kv.num_blocks_for(seq.num_computed_tokens), seq
