"""Parallel sampling's scheduler side: forking a request's choices once it
sampled their first tokens, and the ``max_num_seqs`` slots they hold before.

A request with ``n`` (or ``best_of``) choices is one sequence until the step
that samples its first token; the engine gave it ``pending_forks``, one
``(request id, sampling params, grammar state)`` per extra choice. In that
step the runner samples every choice from the same last row
(``ScheduledRequest.fork_params``, ``ModelOutput.fork_samples``), and
``fork_choices`` turns each into a sequence of its own that shares the
parent's KV (``KVCacheManager.fork``: full blocks by reference, the partial
last block copied)::

    step k     parent: prompt chunk ..L-1, samples choices 0..n-1
    update     parent gets token 0; fork i gets token i, blocks [shared | copy]
    step k+1   n decodes, each writing its own block from position L on

A fork that ends on its first token holds no block; one that finds no free
block waits to be recomputed (its prompt then comes from the prefix cache).
"""

from __future__ import annotations

from typing import Callable, Optional

from cluster.shared.types import FinishReason, TokenLogprob
from workers.engine.kv_manager import KVCacheManager
from workers.engine.request_queue import RequestQueue
from workers.engine.sequence import Sequence, SequenceStatus

StepResult = tuple[Sequence, list[int], Optional[list[TokenLogprob]]]


def slots_taken(queue: RequestQueue) -> int:
    """Running sequences and the choices they will fork: every choice counts against
    ``max_num_seqs`` from its request's admission on, as in vLLM. No mutation."""
    return len(queue.running) + sum(len(s.pending_forks) for s in queue.running)


def fork_choices(seq: Sequence, samples: list[tuple[int, Optional[list[TokenLogprob]]]], kv: KVCacheManager,
                 queue: RequestQueue, check_stop: Callable[[Sequence, int], Optional[FinishReason]]
                 ) -> tuple[list[StepResult], list[tuple[int, int]]]:
    """Forks ``seq``'s pending choices, each with its sampled first token (call it
    before ``seq`` appends its own, which may finish and free it). Mutates the
    queue, the pool and ``seq.pending_forks``.

    Returns:
        ``(results, kv_moves)``: a step result per choice, and the KV rows the
        runner copies before the next forward (the copied partial blocks).
    """
    assert len(samples) == len(seq.pending_forks), (seq.request_id, samples)
    results: list[StepResult] = []
    moves: list[tuple[int, int]] = []
    for (child_id, params, grammar), (token_id, logprobs) in zip(seq.pending_forks, samples):
        child = seq.fork(child_id, params, len(results) + 1)
        child.grammar = grammar
        child.append_token(token_id)
        reason = check_stop(child, token_id)
        if reason is not None:
            child.status = SequenceStatus.FINISHED
            child.finish_reason = reason
        else:
            copies = kv.fork(seq, child)
            if copies is not None:
                moves.extend(copies)
                queue.add_running(child)
            else:
                queue.add(child)
        results.append((child, [token_id], logprobs[:1] if logprobs is not None else None))
    seq.pending_forks = []
    return results, moves
