"""Offline API, named like vLLM's (Ray only for ``tensor_parallel_size > 1``)::

    from workers import LLM, SamplingParams
    llm = LLM()                                   # the packaged default model
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].text)
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence, Union

from cluster.shared.choices import ranking_params, select_best
from cluster.shared.config import EngineConfig
from cluster.shared.types import FinishReason, GenerationRequest, LoRARequest, SamplingParams, TokenLogprob
from workers.builder import build_engine
from workers.engine.lora_slots import slots_in_use
from workers.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int]]


@dataclass
class CompletionOutput:
    """The finished result of one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: Optional[FinishReason] = None
    num_cached_tokens: int = 0
    logprobs: Optional[list[TokenLogprob]] = None
    prompt_logprobs: Optional[list[Optional[TokenLogprob]]] = None  # with SamplingParams.prompt_logprobs
    finish_message: Optional[str] = None  # set when the engine ended it (e.g. out of KV blocks)
    index: int = 0  # which choice of its prompt (SamplingParams.n)
    # With n > 1 (or best_of): every returned choice, this one first; see ``outputs``.
    choices: list["CompletionOutput"] = field(default_factory=list, repr=False)

    @property
    def outputs(self) -> list["CompletionOutput"]:
        """The prompt's choices (vLLM's ``RequestOutput.outputs``): n of them, ``index`` 0 first."""
        return self.choices or [self]

    @property
    def cumulative_logprob(self) -> Optional[float]:
        """Sum of the output tokens' logprobs (None without logprobs)."""
        return sum(lp.logprob for lp in self.logprobs) if self.logprobs is not None else None


class LLM:
    """An engine in this process (its model on tensor-parallel Ray actors when
    ``tensor_parallel_size > 1``; a local Ray on loopback is started if this
    process has none). Call ``shutdown()``, or use it as a context manager, to
    stop the ranks::

        with LLM(tensor_parallel_size=2) as llm:
            llm.generate("Hello")

    Args:
        model: Folder, ``.gguf`` file, or None for the default model.
        **engine_args: vLLM-style engine arguments (``block_size``,
            ``max_num_seqs``, ``max_num_batched_tokens``,
            ``enable_prefix_caching``, ``enable_chunked_prefill``,
            ``swap_space``, ``preemption_mode``, ``num_kv_blocks``,
            ``max_model_len``, ``dtype``, ``seed``, ``tensor_parallel_size``,
            ...). Unknown names raise
            ValueError naming the argument.
    """

    def __init__(self, model: Optional[str] = None, **engine_args: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **engine_args)
        if self.config.parallel.cpu_threads is not None and self.config.parallel.tensor_parallel_size == 1:
            from workers.placement import set_cpu_threads

            set_cpu_threads(self.config.parallel.cpu_threads)  # the forward runs here (ranks set their own)
        parts = build_engine(self.config)
        self.engine = parts.engine
        self.runner = parts.runner
        self.tokenizer = parts.tokenizer
        self.model_dir = parts.model_dir
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stops the tensor-parallel ranks, if any (idempotent); the LLM is unusable after."""
        self.runner.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens (e.g. BOS) as the tokenizer adds
        them, like HF ``tokenizer(text)``. Pass False for chat-rendered text."""
        if self.tokenizer is None:
            raise ValueError(f"{self.model_dir} has no tokenizer.json: pass prompts as token ids")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def make_request(
        self, prompt: Prompt, params: SamplingParams, priority: int = 0, add_special_tokens: bool = True,
        lora_request: Optional[LoRARequest] = None,
    ) -> GenerationRequest:
        """Tokenizes a prompt into a request with a fresh id."""
        ids = self.encode(prompt, add_special_tokens) if isinstance(prompt, str) else list(prompt)
        return GenerationRequest(f"offline-{next(self._ids)}", ids, params, priority=priority,
                                 lora_request=lora_request)

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        priorities: Optional[Sequence[int]] = None,
        lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
    ) -> list[CompletionOutput]:
        """Runs prompts to completion in one continuous batch.

        Args:
            prompts: A string, a list of token ids, or a list of either.
            sampling_params: One for all prompts, or one per prompt.
            priorities: Optional per-prompt priorities (lower first).
            lora_request: A LoRA adapter for every prompt, or one per prompt
                (None: the base model); needs ``enable_lora=True``.

        Returns:
            One output per prompt, in order.

        Raises:
            ValueError: A prompt or its parameters are invalid; nothing runs.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts: pass one or one per prompt")
        prios = list(priorities) if priorities is not None else [0] * len(prompts)
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} lora_request for {len(prompts)} prompts: pass one or one per prompt")
        requests = [self.make_request(p, ranking_params(sp), pr, lora_request=lr)
                    for p, sp, pr, lr in zip(prompts, params, prios, loras)]
        loaded: set[int] = set()
        for req in requests:  # validate all (and load their adapters) before queuing any
            self.engine.validate(req)
            if req.lora_request is not None:
                loaded.add(self.engine.lora.load(req.lora_request, slots_in_use(self.engine.scheduler.queue)
                                                 | loaded)[1])
        grammars = self._compile_grammars(requests)  # before queuing any, too
        results = {r.request_id: [CompletionOutput(r.request_id, list(r.prompt_token_ids), index=i)
                                  for i in range(r.sampling_params.num_choices)] for r in requests}
        for req, grammar in zip(requests, grammars):
            self.engine.add_request(req, grammar)
        for out in self.stream_until_done():
            _accumulate(results[out.request_id][out.index], out)
        return [_choices(results[r.request_id], asked) for r, asked in zip(requests, params)]

    def _compile_grammars(self, requests: list[GenerationRequest]) -> list[object]:
        """Each request's compiled structured-output grammar (None without
        one), all compiling at once on the backend's pool.

        Raises:
            ValueError: One does not compile, or not in time.
        """
        backend = self.engine.structured
        if backend is None:
            return [None] * len(requests)
        for req in requests:
            if req.sampling_params.structured_outputs is not None:
                backend.prepare(req.sampling_params.structured_outputs)
        return [backend.compile(req.sampling_params.structured_outputs)
                if req.sampling_params.structured_outputs is not None else None for req in requests]

    def stream_until_done(self) -> Iterator[RequestOutput]:
        """Steps the engine until no request is left, yielding every output."""
        while self.engine.has_unfinished_requests():
            yield from self.engine.step()


def _choices(outs: list[CompletionOutput], asked: SamplingParams) -> CompletionOutput:
    """The prompt's result: choice 0 holding every returned choice in ``choices``
    (with best_of, the n best by cumulative logprob, renumbered from 0)."""
    if asked.best_of is not None and asked.best_of > asked.n:
        picked = [outs[i] for i in select_best([o.cumulative_logprob or 0.0 for o in outs], asked.n)]
        for i, out in enumerate(picked):
            out.index = i
            if asked.logprobs is None:
                out.logprobs = None
        outs = picked
    if len(outs) > 1:
        outs[0].choices = list(outs)
        for out in outs[1:]:
            out.prompt_logprobs = outs[0].prompt_logprobs
    return outs[0]


def _accumulate(result: CompletionOutput, out: RequestOutput) -> None:
    result.token_ids.extend(out.new_token_ids)
    result.text += out.new_text
    result.num_cached_tokens = out.num_cached_tokens
    if out.new_logprobs:
        result.logprobs = (result.logprobs or []) + list(out.new_logprobs)
    if out.prompt_logprobs is not None:
        result.prompt_logprobs = list(out.prompt_logprobs)
    if out.finish_reason is not None:
        result.finish_reason = out.finish_reason
        result.finish_message = out.finish_message
