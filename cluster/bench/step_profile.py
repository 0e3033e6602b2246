"""Where a decode step's time goes: ``bench latency --profile``.

Times, per engine step, with wall-clock timers wrapped around the layers for
the duration of the measurement (nothing stays patched):

    linear      every linear layer of the decoder (q/k/v, o, gate/up, down)
    attention   the attention backend's calls (KV write + attention)
    other ops   the rest of the forward pass (embedding, norms, rotary, SiLU, adds)
    lm head     the LM head of the sampled rows (``compute_logits``)
    sampler     sampling the next tokens
    python      the rest of ``engine.step()``: scheduling, batch preparation,
                detokenization, outputs

Runs on an engine in this process (``tensor_parallel_size`` 1).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from cluster.shared.types import SamplingParams


def _timed(timers: dict[str, float], key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        begin = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            timers[key] += time.perf_counter() - begin

    return wrapper


@contextmanager
def _instrumented(llm: Any, timers: dict[str, float]) -> Iterator[None]:
    from torch import nn

    runner = llm.runner
    model = getattr(runner, "model", None)
    if model is None:
        raise ValueError("--profile needs the model in this process: use tensor_parallel_size 1")
    patched: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, name: str, key: str) -> None:
        patched.append((obj, name, obj.__dict__.get(name)))
        setattr(obj, name, _timed(timers, key, getattr(obj, name)))

    decoder = getattr(model, "native_decoder", None)
    if decoder is not None:  # its own timers: it calls the kernels without the modules
        decoder.timers = timers
    for module in model.modules():
        if isinstance(module, nn.Linear) and module is not model.lm_head:
            patch(module, "forward", "linear")
    patch(model.model.layers[0].self_attn.attn_backend, "forward", "attention")
    patch(model, "forward", "forward")
    patch(model, "compute_logits", "lm head")
    patch(runner, "sampler", "sampler")
    try:
        yield
    finally:
        if decoder is not None:
            decoder.timers = None
        for obj, name, old in reversed(patched):
            if old is None:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


def profile_decode_step(llm: Any, prompts: list[list[int]], num_steps: int = 8) -> dict[str, float]:
    """Milliseconds per decode step by category (module doc), with all ``prompts`` decoding."""
    engine = llm.engine
    params = SamplingParams(max_tokens=num_steps + 2, temperature=0.0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(llm.make_request(prompt, params))
    started: set[str] = set()
    while len(started) < len(prompts):
        started.update(out.request_id for out in engine.step() if out.new_token_ids)
    engine.step()  # one decode step outside the measurement
    timers: dict[str, float] = defaultdict(float)
    steps = 0
    with _instrumented(llm, timers):
        while engine.has_unfinished_requests():
            begin = time.perf_counter()
            engine.step()
            timers["step"] += time.perf_counter() - begin
            steps += 1
    ms = {k: v * 1e3 / steps for k, v in timers.items()}
    forward = ms.pop("forward", 0.0)
    step = ms.pop("step", 0.0)
    parts = {
        "linear": ms.get("linear", 0.0),
        "attention": ms.get("attention", 0.0),
        "other ops": forward - ms.get("linear", 0.0) - ms.get("attention", 0.0),
        "lm head": ms.get("lm head", 0.0),
        "sampler": ms.get("sampler", 0.0),
    }
    parts["python"] = step - forward - parts["lm head"] - parts["sampler"]
    parts["step"] = step
    return {k: round(v, 2) for k, v in parts.items()}
