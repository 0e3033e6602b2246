"""Pieces of OpenAI response bodies: usage, finish reasons, and the logprob
objects of completions (legacy ``logprobs``, echo), chat and vLLM's
``prompt_logprobs``. Plain functions of the engine's data and the router's
tokenizer (no I/O)."""

from __future__ import annotations

from typing import Any, Optional

from cluster.shared.types import StreamChunk, TokenLogprob
from router.tokenizer import RouterTokenizer


def usage_totals(prompt: int, completion: int, cached: int, reasoning: Optional[int] = None) -> dict[str, Any]:
    """``usage`` of a request: each prompt counted once, the completion tokens of every choice
    (and, with a reasoning parser, how many of them were the think block's)."""
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if reasoning is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return usage


def finish_reason(chunk: StreamChunk) -> Optional[str]:
    """The finish reason as OpenAI spells it (``stop`` / ``length``; ``abort`` as vLLM does), None until the end."""
    return chunk.finish_reason.value if chunk.finish_reason is not None else None


def completion_logprobs(entries: list[TokenLogprob], tokenizer: RouterTokenizer, offset: int) -> dict[str, Any]:
    """Legacy completions ``logprobs`` object for ``entries`` (text offsets start at ``offset``)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        token = tokenizer.decode([entry.token_id], skip_special_tokens=False)
        out["tokens"].append(token)
        out["token_logprobs"].append(entry.logprob)
        out["top_logprobs"].append(
            {tokenizer.decode([t], skip_special_tokens=False): lp for t, lp in entry.top_logprobs}
        )
        out["text_offset"].append(offset)
        offset += len(token)
    return out


def echo_logprobs(prompt_ids: list[int], entries: list[Optional[TokenLogprob]], top: int,
                  tokenizer: RouterTokenizer) -> dict[str, Any]:
    """Legacy completions ``logprobs`` of an echoed prompt: every prompt token, its
    logprob and ``top`` alternatives (``None`` for the first: nothing predicts it)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for i, token_id in enumerate(prompt_ids):
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        entry = entries[i] if i < len(entries) else None
        out["tokens"].append(token)
        out["token_logprobs"].append(entry.logprob if entry is not None else None)
        out["top_logprobs"].append({tokenizer.decode([t], skip_special_tokens=False): lp
                                    for t, lp in entry.top_logprobs[:top]} if entry is not None else None)
        out["text_offset"].append(offset)
        offset += len(token)
    return out


def merge_completion_logprobs(first: Optional[dict[str, Any]], later: Optional[dict[str, Any]],
                              shift: int) -> Optional[dict[str, Any]]:
    """Two legacy ``logprobs`` objects end to end (``later``'s offsets moved by ``shift``)."""
    if first is None or later is None:
        return later if first is None else first
    return {"tokens": first["tokens"] + later["tokens"],
            "token_logprobs": first["token_logprobs"] + later["token_logprobs"],
            "top_logprobs": first["top_logprobs"] + later["top_logprobs"],
            "text_offset": first["text_offset"] + [o + shift for o in later["text_offset"]]}


def prompt_logprobs_body(entries: Optional[list[Optional[TokenLogprob]]], top: int,
                         tokenizer: RouterTokenizer) -> Optional[list[Optional[dict[str, Any]]]]:
    """vLLM's ``prompt_logprobs``: per prompt token ``None`` (the first) or
    ``{token_id: {"logprob", "rank", "decoded_token"}}`` for the token and its ``top`` best
    (rank 1 is the likeliest; None for the prompt's token outside the top)."""
    if entries is None:
        return None
    out: list[Optional[dict[str, Any]]] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranks = {t: r + 1 for r, (t, _) in enumerate(entry.top_logprobs)}
        items = {entry.token_id: entry.logprob, **{t: lp for t, lp in entry.top_logprobs[:top]}}
        out.append({str(t): {"logprob": lp, "rank": ranks.get(t),
                             "decoded_token": tokenizer.decode([t], skip_special_tokens=False)}
                    for t, lp in items.items()})
    return out


def chat_logprobs(entries: list[TokenLogprob], tokenizer: RouterTokenizer) -> dict[str, Any]:
    """Chat ``logprobs`` object (``{"content": [...]}``) for ``entries``."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top_logprobs]}
            for e in entries
        ]
    }
