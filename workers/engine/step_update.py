"""Applying a computed step: the scheduler's ``update_from_output``.

The runner computed the tokens ``schedule()`` picked; here each sequence
advances ``num_computed_tokens``, caches its newly full blocks, gets its
sampled tokens (a request with several choices forks, ``forks.py``; a
verified decode keeps its accepted drafts, ``speculation_slots.py``) and
ends on a token-level stop (``stopping.py``).
"""

from __future__ import annotations

from typing import Callable, Optional

from cluster.shared.types import FinishReason
from workers.engine.forks import StepResult, fork_choices
from workers.engine.kv_manager import KVCacheManager
from workers.engine.outputs import ModelOutput, ScheduledRequest, SchedulerOutput
from workers.engine.request_queue import RequestQueue
from workers.engine.sequence import Sequence, SequenceStatus
from workers.engine.spec_decode import Speculator
from workers.engine.speculation_slots import apply_verified, receive_proposals
from workers.engine.stopping import TokenStops


class StepApplier:
    """Applies the runner's output to the scheduler's sequences.

    Args:
        queue: The scheduler's queues.
        kv_manager: Block tables over the device (and swap) pools.
        stops: The token-level stop rule.
        speculator: Receives acceptance figures and the runner's guesses; may be None.
        sliding_window: When set, blocks outside the window are released after each step.
        finish: Ends a sequence and frees its blocks (the scheduler's).
    """

    def __init__(self, queue: RequestQueue, kv_manager: KVCacheManager, stops: TokenStops,
                 speculator: Optional[Speculator], sliding_window: Optional[int],
                 finish: Callable[[Sequence, FinishReason], None]) -> None:
        self.queue = queue
        self.kv = kv_manager
        self.stops = stops
        self.speculator = speculator
        self.sliding_window = sliding_window
        self.finish = finish
        self.kv_moves: list[tuple[int, int]] = []  # slot copies for the next step (forks, tree branches)

    def take_kv_moves(self) -> list[tuple[int, int]]:
        moves, self.kv_moves = self.kv_moves, []
        return moves

    def apply(self, sched_out: SchedulerOutput, model_out: ModelOutput) -> list[StepResult]:
        """See ``Scheduler.update_from_output`` (mutates sequences, queues and the cache)."""
        assert len(model_out.sampled_token_ids) == len(sched_out.scheduled)
        results: list[StepResult] = []
        for i, req in enumerate(sched_out.scheduled):
            seq = self.queue.get(req.request_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # finished or aborted while the step ran
            assert seq.num_computed_tokens == req.num_computed_tokens, (seq, req)
            if req.spec_token_ids:
                result, reason = apply_verified(seq, req, model_out, i, kv=self.kv, speculator=self.speculator,
                                                check_stop=self.stops.check, kv_moves=self.kv_moves,
                                                sliding_window=self.sliding_window)
                if reason is not None:
                    self.finish(seq, reason)
                results.append(result)
            else:
                results.extend(self._apply_computed(seq, req, model_out, i))
        for seq in [s for s in self.queue.running if s.rope_restart]:
            self._restart_long(seq)
        return results

    def _restart_long(self, seq: Sequence) -> None:
        """A longrope model's sequence that just grew past the original length:
        transformers then recomputes all of it with the long factors, so its KV
        (computed short) is dropped and it waits to be prefilled again, like a
        preemption by recompute. Its short blocks stay cached for short sequences
        (its hashes moved to the long root; ``workers/model/longrope.py``)."""
        self.queue.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.rope_restart = False
        self.queue.requeue(seq, SequenceStatus.WAITING)

    def _apply_computed(self, seq: Sequence, req: ScheduledRequest, model_out: ModelOutput,
                        i: int) -> list[StepResult]:
        seq.num_computed_tokens += req.num_input_tokens
        if model_out.prompt_logprobs is not None and model_out.prompt_logprobs[i] is not None:
            first, entries = model_out.prompt_logprobs[i]
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs = [None] * len(seq.prompt_token_ids)
            seq.prompt_logprobs[first : first + len(entries)] = entries  # a recompute writes the same places
        self.kv.cache_computed_blocks(seq)
        if self.sliding_window is not None:
            self.kv.release_outside_window(seq, self.sliding_window)
        sampled = model_out.sampled_token_ids[i]
        assert len(sampled) == req.num_sample_tokens, (req.request_id, sampled)
        if not sampled:
            return []
        forks = []
        if req.fork_params:
            assert model_out.fork_samples is not None and model_out.fork_samples[i] is not None, req.request_id
            forks, moves = fork_choices(seq, model_out.fork_samples[i], self.kv, self.queue, self.stops.check)
            self.kv_moves.extend(moves)
        new_ids = self._append_tokens(seq, sampled)
        receive_proposals(self.speculator, seq, model_out, i)
        logprobs = model_out.logprobs[i] if i < len(model_out.logprobs) else None
        return [(seq, new_ids, logprobs[: len(new_ids)] if logprobs is not None else None), *forks]

    def _append_tokens(self, seq: Sequence, token_ids: list[int]) -> list[int]:
        kept = []
        for token_id in token_ids:
            seq.append_token(token_id)
            kept.append(token_id)
            reason = self.stops.check(seq, token_id)
            if reason is not None:
                self.finish(seq, reason)
                break
        return kept
