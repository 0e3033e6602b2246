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

A waiting sequence whose next uncached block a running sequence is
prefilling waits for it (``admission.py``).

Chunked prefill: a sequence gets ``min(uncomputed tokens, budget left)``
tokens a step and samples when it reaches its last known token
(``admission.py``).

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

from cluster.shared.config import SchedulerConfig
from cluster.shared.types import FinishReason
from workers.engine.admission import blocks_in_prefill, chunk_size, queued_prefill_tokens, waits_for_prefill
from workers.engine.forks import StepResult, slots_taken
from workers.engine.kv_manager import KVCacheManager
from workers.engine.lora_slots import adapter_fits
from workers.engine.outputs import ModelOutput, SchedulerOutput
from workers.engine.request_queue import RequestQueue
from workers.engine.sequence import Sequence, SequenceStatus
from workers.engine.spec_decode import Speculator
from workers.engine.speculation_slots import propose_drafts
from workers.engine.step_request import make_scheduled
from workers.engine.step_update import StepApplier
from workers.engine.stopping import TokenStops
from workers.engine.structured import GrammarBackend
from workers.engine.validation import Capacity, fit_problem


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
        self.max_loras = 1  # distinct LoRA adapters in a step (lora_slots.py); the builder sets max_loras
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.preemption_mode = scheduler_config.preemption_mode
        self._chunking = dict(enable_chunked_prefill=self.enable_chunked_prefill,
                              max_num_batched_tokens=self.max_num_batched_tokens)
        self.kv_manager = kv_manager
        self.max_model_len = max_model_len
        self.stops = TokenStops(eos_token_ids, max_model_len)
        self.sliding_window = sliding_window
        self.structured = structured

        self.queue = RequestQueue()
        self._finished_ids: set[str] = set()  # since the last schedule()
        self._finished_in_schedule: list[Sequence] = []  # reported by update_from_output
        self._applier = StepApplier(self.queue, kv_manager, self.stops, speculator, sliding_window, self._finish)
        self.num_preemptions_total = 0

    @property
    def speculator(self) -> Optional[Speculator]:
        return self._applier.speculator

    @speculator.setter
    def speculator(self, speculator: Optional[Speculator]) -> None:  # benches swap it between runs
        self._applier.speculator = speculator

    # ---------------------------------------------------------------- figures
    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.stops.eos_token_ids

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
        """Prompt tokens whose KV is not computed yet (``admission.queued_prefill_tokens``)."""
        return queued_prefill_tokens(self.queue.running, self.queue.waiting, self.kv_manager)

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
            scheduled=[make_scheduled(seq, n, plan.drafts.get(seq, ((), ())), speculator=self.speculator,
                                      structured=self.structured, stops=self.stops)
                       for seq, n in plan.scheduled.items()],
            swap_out=plan.swap_out,
            swap_in=plan.swap_in,
            finished_request_ids=self._finished_ids,
            kv_moves=self._applier.take_kv_moves(),
        )
        self._finished_ids = set()
        return out

    def _schedule_running(self, plan: _StepPlan) -> None:
        order = sorted(self.queue.running, key=lambda s: (s.num_uncomputed_tokens > 1, self.queue.key(s)))
        proposals = propose_drafts(self.speculator, order, plan.budget, self.max_model_len)
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
        return (slots_taken(self.queue) + 1 + len(seq.pending_forks) <= self.max_num_seqs
                and adapter_fits(seq, self.queue.running, self.max_loras))

    def _schedule_swapped(self, plan: _StepPlan) -> None:
        swapped = self.queue.swapped
        while swapped and plan.budget > 0 and self._has_slots_for(swapped[0]):
            seq = swapped[0]
            if self._never_fits(seq.num_tokens):
                self._finish_for_capacity(seq)
                continue
            num_new = chunk_size(seq, seq.num_computed_tokens, plan.budget, **self._chunking)
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
                    if in_flight is None:
                        in_flight = blocks_in_prefill(self.queue.running, self.kv_manager.block_size)
                    if waits_for_prefill(seq, num_hit_tokens, self.kv_manager.block_size, in_flight):
                        break  # a running prefill computes it: start from the cache next step
            else:  # every prompt token is computed for its logprob
                hit_blocks, num_hit_tokens = [], 0
            num_new = chunk_size(seq, num_hit_tokens, plan.budget, **self._chunking)
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

    def _start_running(self, seq: Sequence, num_new: int, plan: _StepPlan) -> None:
        seq.status = SequenceStatus.RUNNING
        self.queue.running.append(seq)
        plan.scheduled[seq] = num_new
        plan.budget -= num_new

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

    # ------------------------------------------------------------------ update
    def update_from_output(self, sched_out: SchedulerOutput, model_out: ModelOutput) -> list[StepResult]:
        """Applies a computed step (mutates sequences, queues and the cache;
        ``step_update.py``).

        Advances ``num_computed_tokens``, caches newly full blocks, appends
        sampled tokens and applies token-level stops, freeing finished
        sequences. Requests aborted during the step are skipped.

        Returns:
            ``(seq, new_token_ids, new_logprobs)`` for every sequence that got
            tokens or finished; ``seq.finish_reason`` is set when it ended
            (including sequences ``schedule()`` ended for lack of KV space,
            with ``seq.finish_message`` saying why).
        """
        results: list[StepResult] = [(seq, [], None) for seq in self._finished_in_schedule]
        self._finished_in_schedule = []
        return results + self._applier.apply(sched_out, model_out)

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
