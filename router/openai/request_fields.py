"""The request fields that ask for several choices (``n``, ``best_of``) and
that edit the logits (OpenAI's ``logit_bias``, vLLM's ``allowed_token_ids``,
``bad_words``, ``min_tokens``): parsed and checked for
``router.openai.protocol``, as ``SamplingParams`` keyword arguments. Errors
are 400s naming the field and the value allowed."""

from __future__ import annotations

import json
from typing import Any, Optional

from router.limits import Limits
from router.openai.errors import bad_request, is_ids, number
from router.reasoning import effort_template_kwargs


def choice_fields(body: dict, chat: bool, limits: Limits) -> dict[str, Any]:
    """``n`` and ``best_of`` (completions only), within ``max_n``; best_of >= n, not streamed."""
    out: dict[str, Any] = {}
    n = number(body, "n", integer=True)
    if n is not None:
        if n < 1:
            raise bad_request(f"n must be >= 1, got {n}", "n")
        limits.check_n(n, "n")
        out["n"] = n
    best_of = None if chat else number(body, "best_of", integer=True)
    if best_of is not None:
        if best_of < (n or 1):
            raise bad_request(f"best_of = {best_of} must be >= n = {n or 1}: raise best_of or lower n", "best_of")
        limits.check_n(best_of, "best_of")
        if best_of > (n or 1) and body.get("stream"):
            raise bad_request("best_of cannot be streamed (the best choices are known only at the end): "
                              "set stream to false or leave best_of unset", "best_of")
        out["best_of"] = best_of
    return out


def _token_id_list(body: dict, name: str, vocab_size: Optional[int]) -> Optional[tuple[int, ...]]:
    value = body.get(name)
    if value is None:
        return None
    if not is_ids(value) or not value:
        raise bad_request(f"{name} must be a non-empty list of integer token ids", name)
    bad = [t for t in value if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise bad_request(f"{name} holds {bad[0]}, not a token id: ids must be in [0, {vocab_size})", name)
    return tuple(value)


def processor_fields(body: dict, vocab_size: Optional[int]) -> dict[str, Any]:
    """``logit_bias`` (OpenAI: token id -> [-100, 100]) and vLLM's ``allowed_token_ids``,
    ``bad_words`` and ``min_tokens``."""
    out: dict[str, Any] = {}
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise bad_request('logit_bias must be an object mapping token ids to biases, like {"50256": -100}',
                              "logit_bias")
        pairs = []
        for key, value in bias.items():
            text = str(key).strip()
            if not (text.isdigit() and (vocab_size is None or int(text) < vocab_size)):
                limit = f"[0, {vocab_size})" if vocab_size is not None else "integers >= 0"
                raise bad_request(f"logit_bias key {key!r} is not a token id: keys must be token ids in {limit}",
                                  "logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise bad_request(f"logit_bias[{key!r}] = {value!r} is out of range: biases must be numbers "
                                  "in [-100, 100]", "logit_bias")
            pairs.append((int(text), float(value)))
        out["logit_bias"] = tuple(pairs)
    allowed = _token_id_list(body, "allowed_token_ids", vocab_size)
    if allowed is not None:
        out["allowed_token_ids"] = allowed
    words = body.get("bad_words")
    if words is not None:
        if isinstance(words, str):
            words = [words]
        if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
            raise bad_request("bad_words must be a list of non-empty strings", "bad_words")
        out["bad_words"] = tuple(words)
    min_tokens = number(body, "min_tokens", integer=True)
    if min_tokens is not None:
        out["min_tokens"] = min_tokens
    return out


def template_kwargs(body: dict, template_source: Optional[str] = None) -> Optional[dict[str, Any]]:
    """vLLM's ``chat_template_kwargs``: more variables for the chat template
    (e.g. ``{"enable_thinking": false}`` for Qwen3), with those OpenAI's
    ``reasoning_effort`` sets (``router.reasoning.effort_template_kwargs``);
    None when neither is set. A variable both set differently is a 400."""
    value = body.get("chat_template_kwargs")
    if value is not None and not isinstance(value, dict):
        raise bad_request("chat_template_kwargs must be an object of template variables, e.g. "
                          "{'enable_thinking': false}", "chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is None:
        return value
    try:
        implied = effort_template_kwargs(effort, template_source)
    except ValueError as exc:
        raise bad_request(str(exc), "reasoning_effort") from None
    for name, wanted in implied.items():
        if name in (value or {}) and value[name] != wanted:
            raise bad_request(f"reasoning_effort {effort!r} sets the template's {name} to {json.dumps(wanted)}, but "
                              f"chat_template_kwargs sets it to {json.dumps(value[name])}: send one of them",
                              "reasoning_effort")
    return {**implied, **(value or {})}
