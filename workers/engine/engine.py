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

import contextlib
import dataclasses
import logging
import time
from typing import Any, Callable, Optional, Protocol

from cluster.shared.types import FinishReason, GenerationRequest, ReplicaStats, SamplingParams
from cluster.shared.choices import choice_params
from cluster.shared.detokenizer import IncrementalDetokenizer, TokenDecoder
from cluster.shared.hashing import lora_fingerprint
from workers.engine.lora_slots import slots_in_use
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
        long_rope_after: A longrope model's ``original_max_position_embeddings``
            (longer sequences use its long factors); None for other models.
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
        long_rope_after: Optional[int] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.model_fingerprint = model_fingerprint
        self.long_rope_after = long_rope_after
        self._clock = clock
        self._detok: dict[str, Optional[IncrementalDetokenizer]] = {}
        self._seqs: dict[str, Sequence] = {}  # every live choice, by its engine id
        self._groups: dict[str, _Group] = {}  # requests with several choices, by request id
        self.num_steps = 0
        self.schedule_seconds = 0.0  # in schedule(), proposals included (bench spec: what speculation costs)
        self.structured = scheduler.structured  # the grammar backend of structured outputs (None: refused)
        self.lora: Any = None  # workers.lora.manager.LoRAManager with enable_lora (None: adapters refused)

    # ----------------------------------------------------------- requests
    def validate(self, request: GenerationRequest) -> None:
        """Raises ValueError saying what to change if the request cannot run
        (``validation.py``: the request itself, then whether it fits). No mutation."""
        check_request(request, self.vocab_size)
        if request.sampling_params.structured_outputs is not None and self.structured is None:
            raise ValueError("structured_outputs needs a grammar backend, and this engine has none: install "
                             "xgrammar (pip install xgrammar) and give the model a tokenizer.json")
        if request.lora_request is not None and self.lora is None:
            raise ValueError(f"LoRA adapter {request.lora_request.lora_name!r} asked, but this engine serves no "
                             "adapters: start it with enable_lora=True (--enable-lora)")
        if request.request_id in self._seqs or request.request_id in self._groups:
            raise ValueError(f"request id {request.request_id!r} is already running: use a unique id")
        params = request.sampling_params
        num_choices = params.num_choices
        if num_choices > 1:
            max_num_seqs = self.scheduler.max_num_seqs
            if num_choices > max_num_seqs:
                name = "best_of" if params.best_of is not None else "n"
                raise ValueError(f"{name} is {num_choices} but this replica runs at most max_num_seqs = "
                                 f"{max_num_seqs} sequences at once: lower {name}")
            if request.num_resumed_output_tokens:
                raise ValueError("num_resumed_output_tokens cannot be combined with n / best_of > 1: resume "
                                 "each choice as its own request")
            taken = [cid for cid in _choice_ids(request.request_id, num_choices) if cid in self._seqs]
            if taken:
                raise ValueError(f"request id {request.request_id!r} collides with choice {taken[0]!r} of a "
                                 "running request: use a unique id")
        vocab = self.vocab_size
        named = [t for t, _ in params.logit_bias if t >= vocab]
        if named:
            raise ValueError(f"logit_bias names token {named[0]}, outside the vocabulary [0, {vocab})")
        if params.allowed_token_ids is not None and any(t >= vocab for t in params.allowed_token_ids):
            raise ValueError(f"allowed_token_ids must be below the vocabulary size {vocab}")
        if any(t >= vocab for word in params.bad_words_token_ids for t in word):
            raise ValueError(f"bad_words_token_ids must be below the vocabulary size {vocab}")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words needs the model's tokenizer; send bad_words_token_ids instead")
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
        params = self._engine_params(request.sampling_params)
        grammar = self._new_grammar(request, compiled_grammar)
        lora, fingerprint = None, self.model_fingerprint
        if request.lora_request is not None:  # loaded now if it is not; its KV hashes on its content
            lora = self.lora.acquire(request.lora_request, slots_in_use(self.scheduler.queue))
            fingerprint = lora_fingerprint(fingerprint, lora.content_hash)
        seq = Sequence(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=choice_params(params, 0),
            block_size=self.scheduler.kv_manager.block_size,
            model_fingerprint=fingerprint,
            cache_salt=request.cache_salt,
            priority=request.priority,
            arrival_time=request.arrival_time or self._clock(),
            long_rope_after=self.long_rope_after,
        )
        seq.queued_time = self._clock()
        seq.grammar = grammar
        seq.lora = lora
        num_choices = params.num_choices
        if num_choices > 1:
            ids = _choice_ids(request.request_id, num_choices)
            seq.pending_forks = [(ids[i], choice_params(params, i), self._new_grammar(request, compiled_grammar))
                                 for i in range(1, num_choices)]
            self._groups[request.request_id] = _Group(ids)
        self._seqs[request.request_id] = seq
        self._detok[request.request_id] = self._new_detokenizer(seq)
        self.scheduler.add_request(seq)

    def _new_detokenizer(self, seq: Sequence) -> Optional[IncrementalDetokenizer]:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, seq.sampling_params.stop)

    def _engine_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` with ``bad_words`` tokenized into ``bad_words_token_ids`` (vLLM's
        rule: each word as it is and after a space, its last token banned after the rest)."""
        if not params.bad_words:
            return params
        words = set(params.bad_words_token_ids)
        for word in params.bad_words:
            for text in (word, " " + word.lstrip()):
                ids = tuple(self.tokenizer.encode(text, add_special_tokens=False).ids)
                if ids:
                    words.add(ids)
        return dataclasses.replace(params, bad_words_token_ids=tuple(sorted(words)))

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
        group = self._groups.get(request_id)
        if group is not None:  # every choice still running; the last output ends the request
            last = None
            for choice_id in group.choice_ids:
                seq = self._seqs.get(choice_id)
                if seq is not None and self.scheduler.abort_request(choice_id):
                    last = self._finish_output(seq, [], None, FinishReason.ABORT)
            return last
        seq = self._seqs.get(request_id)
        if seq is None or not self.scheduler.abort_request(request_id):
            return None
        return self._finish_output(seq, [], None, FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # --------------------------------------------------------------- step
    # The caller's hold on the block pool while it steps (``pool_gate.py``), lent during the forward:
    # another thread may then pin or release cached blocks (KV transfers) without waiting for the step.
    forward_gate: Any = None

    def step(self) -> list[RequestOutput]:
        """Runs one scheduling + model step; returns the outputs of this step."""
        started = time.perf_counter()  # schedule() included: a draft model proposes there
        sched = self.scheduler.schedule()
        self.schedule_seconds += time.perf_counter() - started
        self._note_first_scheduled(sched)
        if sched.is_empty:
            # schedule() may have finished requests that can never fit; they
            # are reported through update_from_output like any other. What it waits for may be
            # blocks a KV transfer pinned: their release needs the gate (pool_gate.py).
            model_out = ModelOutput(sampled_token_ids=[], logprobs=[])
            if self.forward_gate is not None:
                self.forward_gate.pause()
        else:
            with self.forward_gate.lent() if self.forward_gate is not None else contextlib.nullcontext():
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
        if self.lora is not None:
            if not sched.is_empty:  # the prefill rate that prices an adapter load (workers/lora/load_cost.py)
                self.lora.cost.observe_step(sched.num_batched_tokens, time.perf_counter() - started)
            if self.lora.over_capacity:  # adapters held past max_cpu_loras while in use
                self.lora.trim(slots_in_use(self.scheduler.queue))
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
        if seq.request_id not in self._seqs and seq.group_id in self._groups:  # a choice forked this step
            self._seqs[seq.request_id] = seq
            self._detok[seq.request_id] = self._new_detokenizer(seq)
        detok = self._detok.get(seq.request_id)
        text = detok.append(new_ids) if detok is not None else ""
        reason = seq.finish_reason
        if detok is not None and detok.stopped and reason is None:
            self.scheduler.finish_request(seq.request_id, FinishReason.STOP)
            reason = FinishReason.STOP
        if reason is None:
            return RequestOutput(
                request_id=seq.group_id,
                new_token_ids=new_ids,
                new_text=text,
                finish_reason=None,
                num_prompt_tokens=len(seq.prompt_token_ids),
                num_output_tokens=len(seq.output_token_ids),
                num_cached_tokens=seq.num_cached_tokens,
                new_logprobs=new_logprobs,
                prompt_logprobs=_take_prompt_logprobs(seq),
                queue_time=_queue_time(seq),
                index=seq.choice_index,
                more_choices=seq.group_id in self._groups,
            )
        out = self._finish_output(seq, new_ids, new_logprobs, reason)
        out.new_text = text + out.new_text
        return out

    def _finish_output(self, seq: Sequence, new_ids, new_logprobs, reason: FinishReason) -> RequestOutput:
        detok = self._detok.pop(seq.request_id, None)
        self._seqs.pop(seq.request_id, None)
        more = False
        group = self._groups.get(seq.group_id)
        if group is not None:
            group.num_finished += 1 + len(seq.pending_forks)  # choices never forked end with it
            seq.pending_forks = []
            more = group.num_finished < len(group.choice_ids)
            if not more:
                del self._groups[seq.group_id]
        return RequestOutput(
            request_id=seq.group_id,
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
            index=seq.choice_index,
            more_choices=more,
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
            lora_adapters=self.lora.published if self.lora is not None else (),
            max_cpu_loras=self.lora.capacity if self.lora is not None else 0,
            lora_load_tokens=self.lora.cost.load_tokens if self.lora is not None else 0.0,
        )


@dataclasses.dataclass
class _Group:
    """The choices of one request with n / best_of > 1 (choice 0 has the request's id)."""

    choice_ids: list[str]
    num_finished: int = 0


def _choice_ids(request_id: str, num_choices: int) -> list[str]:
    """Engine ids of a request's choices: the request's own, then ``<id>#n<i>``."""
    return [request_id] + [f"{request_id}#n{i}" for i in range(1, num_choices)]


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
