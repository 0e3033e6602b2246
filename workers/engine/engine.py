"""The engine: validates requests, steps the scheduler and the runner, and
turns sampled tokens into per-request outputs (text deltas, stops).

Pure Python: the model runner is injected (anything with
``execute(SchedulerOutput) -> ModelOutput``), so tests drive the whole
control plane with a fake runner, and the runner may live on other processes.

One step::

    scheduler.schedule() -> SchedulerOutput -> runner.execute() -> ModelOutput
      -> scheduler.update_from_output()   (token-level stops, frees blocks)
      -> detokenize, stop strings         (may finish more requests)
      -> list[RequestOutput]
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Protocol

from cluster.shared.types import FinishReason, GenerationRequest, ReplicaStats
from cluster.shared.detokenizer import IncrementalDetokenizer, TokenDecoder
from workers.engine.outputs import ModelOutput, RequestOutput, SchedulerOutput
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import Sequence
from workers.engine.validation import check_request

logger = logging.getLogger(__name__)


class Runner(Protocol):
    def execute(self, sched: SchedulerOutput) -> ModelOutput: ...


class LLMEngine:
    """Continuous-batching engine over one model runner.

    Args:
        scheduler: The scheduler (owns the KV manager).
        runner: Executes scheduler outputs.
        tokenizer: Decodes token ids (``tokenizers.Tokenizer`` or similar).
        vocab_size: Token ids must be below it.
        max_model_len: Longest prompt + output.
        model_fingerprint: Identifies the weights in block hashes.
        clock: Time source for arrival times (injectable in tests).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        tokenizer: Optional[TokenDecoder],
        *,
        vocab_size: int,
        max_model_len: int,
        model_fingerprint: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.model_fingerprint = model_fingerprint
        self._clock = clock
        self._detok: dict[str, Optional[IncrementalDetokenizer]] = {}
        self._seqs: dict[str, Sequence] = {}
        self.num_steps = 0
        self.schedule_seconds = 0.0  # in schedule(), proposals included (bench spec: what speculation costs)
        self.structured = scheduler.structured  # the grammar backend of structured outputs (None: refused)

    # ----------------------------------------------------------- requests
    def validate(self, request: GenerationRequest) -> None:
        """Raises ValueError saying what to change if the request cannot run
        (``validation.py``: the request itself, then whether it fits). No mutation."""
        check_request(request, self.vocab_size)
        if request.sampling_params.structured_outputs is not None and self.structured is None:
            raise ValueError("structured_outputs needs a grammar backend, and this engine has none: install "
                             "xgrammar (pip install xgrammar) and give the model a tokenizer.json")
        if request.request_id in self._seqs:
            raise ValueError(f"request id {request.request_id!r} is already running: use a unique id")
        problem = self.scheduler.check_request_fits(len(request.prompt_token_ids), request.sampling_params.max_tokens)
        if problem:
            raise ValueError(problem)

    def add_request(self, request: GenerationRequest, compiled_grammar: object = None) -> None:
        """Validates and queues a request (mutates engine state).

        Args:
            request: The request.
            compiled_grammar: Its structured-output grammar, compiled ahead
                (``AsyncEngine`` compiles off this thread); None compiles it
                here when the request has one (cached, with the timeout).

        Raises:
            ValueError: The request cannot run (or its grammar does not
                compile); nothing was queued.
        """
        self.validate(request)
        grammar = self._new_grammar(request, compiled_grammar)
        seq = Sequence(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=request.sampling_params,
            block_size=self.scheduler.kv_manager.block_size,
            model_fingerprint=self.model_fingerprint,
            cache_salt=request.cache_salt,
            priority=request.priority,
            arrival_time=request.arrival_time or self._clock(),
        )
        seq.queued_time = self._clock()
        seq.grammar = grammar
        self._seqs[request.request_id] = seq
        self._detok[request.request_id] = (
            IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, request.sampling_params.stop)
            if self.tokenizer is not None
            else None
        )
        self.scheduler.add_request(seq)

    def _new_grammar(self, request: GenerationRequest, compiled: object) -> object:
        """The request's grammar state, advanced over the output tokens a
        migrated stream already delivered (None without a constraint)."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return None
        assert self.structured is not None  # validate() refused it otherwise
        state = self.structured.new_state(params, compiled)
        resumed = request.prompt_token_ids[len(request.prompt_token_ids) - request.num_resumed_output_tokens:]
        for i, token in enumerate(resumed if request.num_resumed_output_tokens else ()):
            if not state.accept(token):
                raise ValueError(f"num_resumed_output_tokens: resumed output token {i} ({token}) is outside the "
                                 "request's structured-output grammar")
        return state

    def abort_request(self, request_id: str) -> Optional[RequestOutput]:
        """Aborts a request at any point and frees its blocks (mutates state).

        Returns:
            The final output (finish reason ``abort``), or None if unknown.
        """
        seq = self._seqs.get(request_id)
        if seq is None or not self.scheduler.abort_request(request_id):
            return None
        return self._finish_output(seq, [], None, FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # --------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Runs one scheduling + model step; returns the outputs of this step."""
        started = time.perf_counter()  # schedule() included: a draft model proposes there
        sched = self.scheduler.schedule()
        self.schedule_seconds += time.perf_counter() - started
        self._note_first_scheduled(sched)
        if sched.is_empty:
            # schedule() may have finished requests that can never fit; they
            # are reported through update_from_output like any other.
            model_out = ModelOutput(sampled_token_ids=[], logprobs=[])
        else:
            model_out = self.runner.execute(sched)
            self.num_steps += 1
            speculator = self.scheduler.speculator
            if speculator is not None:  # what a step of this size (and its proposals) costs
                num_sampling = sum(1 for r in sched.scheduled if r.num_sample_tokens)
                num_drafts = sum(len(r.spec_token_ids) for r in sched.scheduled)
                # Guesses the runner makes for the next step (Medusa heads: an LM-head pass) are
                # priced with the drafts they become, so heads that cost more than they bring stop.
                num_guesses = sum(r.num_proposals for r in sched.scheduled) if speculator.from_runner else 0
                speculator.observe_step(sched.num_batched_tokens - num_drafts, num_drafts + num_guesses,
                                        num_sampling, time.perf_counter() - started, num_guesses=num_guesses)
        outputs = []
        for seq, new_ids, new_logprobs in self.scheduler.update_from_output(sched, model_out):
            outputs.append(self._make_output(seq, new_ids, new_logprobs))
        return outputs

    def _note_first_scheduled(self, sched: SchedulerOutput) -> None:
        """Stamps requests scheduled for the first time (for their queue time)."""
        now = None
        for scheduled in sched.scheduled:
            seq = self._seqs.get(scheduled.request_id)
            if seq is not None and seq.first_scheduled_time is None:
                now = self._clock() if now is None else now
                seq.first_scheduled_time = now

    def _make_output(self, seq: Sequence, new_ids: list[int], new_logprobs) -> RequestOutput:
        detok = self._detok.get(seq.request_id)
        text = detok.append(new_ids) if detok is not None else ""
        reason = seq.finish_reason
        if detok is not None and detok.stopped and reason is None:
            self.scheduler.finish_request(seq.request_id, FinishReason.STOP)
            reason = FinishReason.STOP
        if reason is None:
            return RequestOutput(
                request_id=seq.request_id,
                new_token_ids=new_ids,
                new_text=text,
                finish_reason=None,
                num_prompt_tokens=len(seq.prompt_token_ids),
                num_output_tokens=len(seq.output_token_ids),
                num_cached_tokens=seq.num_cached_tokens,
                new_logprobs=new_logprobs,
                prompt_logprobs=_take_prompt_logprobs(seq),
                queue_time=_queue_time(seq),
            )
        out = self._finish_output(seq, new_ids, new_logprobs, reason)
        out.new_text = text + out.new_text
        return out

    def _finish_output(self, seq: Sequence, new_ids, new_logprobs, reason: FinishReason) -> RequestOutput:
        detok = self._detok.pop(seq.request_id, None)
        self._seqs.pop(seq.request_id, None)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_ids,
            new_text=detok.flush() if detok is not None else "",
            finish_reason=reason,
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_output_tokens=len(seq.output_token_ids),
            num_cached_tokens=seq.num_cached_tokens,
            new_logprobs=new_logprobs,
            prompt_logprobs=_take_prompt_logprobs(seq),
            finish_message=seq.finish_message,
            queue_time=_queue_time(seq),
        )

    # -------------------------------------------------------------- stats
    def stats(self, replica_id: str = "") -> ReplicaStats:
        kv = self.scheduler.kv_manager
        return ReplicaStats(
            replica_id=replica_id,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_swapped=self.scheduler.num_swapped,
            kv_cache_usage=kv.usage,
            num_cached_blocks=kv.num_cached_blocks,
            num_prefill_tokens=self.scheduler.num_prefill_tokens,
            num_decode_tokens=self.scheduler.num_decode_tokens,
            num_kv_blocks=kv.num_device_blocks,
            at=time.time(),
        )


def _take_prompt_logprobs(seq: Sequence) -> Optional[list]:
    """The prompt's logprobs, in the request's first output only (None without them)."""
    if seq.sampling_params.prompt_logprobs is None or seq.prompt_logprobs_sent:
        return None
    seq.prompt_logprobs_sent = True
    return seq.prompt_logprobs if seq.prompt_logprobs is not None else [None] * len(seq.prompt_token_ids)


def _queue_time(seq: Sequence) -> Optional[float]:
    """Seconds the sequence waited before it was first scheduled (None: not yet)."""
    if seq.first_scheduled_time is None or seq.queued_time is None:
        return None
    return max(0.0, seq.first_scheduled_time - seq.queued_time)
