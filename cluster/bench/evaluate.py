"""``prefixserve eval perplexity``: perplexity on held-out text, and greedy
agreement with a reference run.

    prefixserve eval perplexity                       # the default model, float32
    prefixserve eval perplexity --quantization gguf   # its GGUF tensors, natively
    prefixserve eval perplexity --quantization int8 --agreement
    prefixserve eval perplexity --kv-cache-dtype int8 --prefill-chunk 64

Text: the held-out part of ``cluster/shared/text_corpus.py`` (English shipped
with Python; quantizers calibrate on the other part). It is tokenized once and
cut into non-overlapping windows of ``--window`` tokens, at most
``--max-tokens`` in all; each window is one prompt whose prompt logprobs
(``SamplingParams.prompt_logprobs``) give every token's negative log-likelihood
but the window's first. Perplexity = exp(mean NLL over those tokens). A window
prefilled in one step attends to its own fresh keys; ``--prefill-chunk`` makes
later chunks read earlier tokens back from the KV cache (what an int8 cache
changes).

``--agreement`` also runs the float model (no quantization) and reports, over
``--num-prompts`` prompts (held-out text), how many greedy tokens the two runs
share before the first divergence (of ``--agree-tokens``).

Prints a table and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from pathlib import Path
from typing import Any

from cluster.client.table import format_table
from cluster.shared.text_corpus import held_out_text, token_windows

logger = logging.getLogger(__name__)


def add_perplexity_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--window", type=int, default=512, help="tokens per evaluated window")
    parser.add_argument("--max-tokens", type=int, default=4096, help="held-out tokens evaluated in all")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="prefill windows in chunks of this many tokens, so tokens attend to cached keys "
                             "(what kv_cache_dtype int8 changes); default: a window in one step")
    parser.add_argument("--agreement", action="store_true",
                        help="also compare greedy outputs with the float run (loads the model twice)")
    parser.add_argument("--reference-model", default=None,
                        help="the float model --agreement compares with (needed when --model is a GPTQ / AWQ "
                             "checkpoint; default: --model without --quantization)")
    parser.add_argument("--num-prompts", type=int, default=20, help="prompts of the agreement check")
    parser.add_argument("--agree-tokens", type=int, default=32, help="greedy tokens per agreement prompt")
    parser.add_argument("--json", default="perplexity.json", help="where to write the results")


def perplexity(llm: Any, window: int = 512, max_tokens: int = 4096) -> dict[str, Any]:
    """Perplexity of ``llm`` on the held-out text (see the module doc)."""
    from cluster.shared.types import SamplingParams

    windows = token_windows(llm.encode(held_out_text()), window, max_tokens)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    start = time.perf_counter()
    outs = llm.generate(windows, params)
    seconds = time.perf_counter() - start
    nll = [-entry.logprob for out in outs for entry in out.prompt_logprobs[1:]]
    result = {"perplexity": round(math.exp(sum(nll) / len(nll)), 4), "tokens": len(nll), "windows": len(windows),
              "window": window, "seconds": round(seconds, 2)}
    logger.info("perplexity %.4f over %d tokens (%d windows of %d) in %.1f s", result["perplexity"], len(nll),
                len(windows), window, seconds)
    return result


def agreement_prompts(llm: Any, num_prompts: int, length: int = 24) -> list[list[int]]:
    """``num_prompts`` prompts of ``length`` tokens cut from the held-out text."""
    ids = llm.encode(held_out_text())
    step = max(length, (len(ids) - length) // max(1, num_prompts))
    prompts = [ids[i : i + length] for i in range(0, len(ids) - length, step)][:num_prompts]
    if len(prompts) < num_prompts:
        raise ValueError(f"the held-out text gives {len(prompts)} prompts of {length} tokens, not {num_prompts}")
    return prompts


def greedy_tokens(llm: Any, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    from cluster.shared.types import SamplingParams

    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params)]


def agreement(ours: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    """Tokens until the first divergence, per prompt: mean, min, and how many agree in full."""
    lengths = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
               for x, y in zip(ours, reference)]
    full = sum(n == len(r) for n, r in zip(lengths, reference))
    return {"mean_tokens_to_divergence": round(statistics.mean(lengths), 2), "min": min(lengths),
            "full_agreement": f"{full}/{len(lengths)}", "out_of": len(reference[0]) if reference else 0,
            "per_prompt": lengths}


def run_perplexity(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    from workers.llm import LLM

    engine_args = {"max_num_batched_tokens": max(2048, args.window), **engine_args}
    if args.prefill_chunk:
        engine_args.update(max_num_batched_tokens=args.prefill_chunk,
                           max_num_seqs=min(args.prefill_chunk, engine_args.get("max_num_seqs", 64)))
    llm = LLM(**engine_args)
    quantization = getattr(llm.runner, "quantization", None)  # the --quantization's, or the checkpoint's (gptq-g128)
    if args.agreement and quantization and not engine_args.get("quantization") and not args.reference_model:
        llm.shutdown()
        raise ValueError(f"{llm.model_dir} is a quantized checkpoint ({quantization}): --agreement needs the float "
                         "model to compare with, pass --reference-model FOLDER")
    report: dict[str, Any] = {"model": str(llm.model_dir), "quantization": quantization,
                              **perplexity(llm, args.window, args.max_tokens)}
    if args.agreement:
        prompts = agreement_prompts(llm, args.num_prompts)
        ours = greedy_tokens(llm, prompts, args.agree_tokens)
        llm.shutdown()
        float_args = {k: v for k, v in engine_args.items() if not k.startswith("quantization")}
        if args.reference_model:
            float_args["model"] = args.reference_model
        with LLM(**float_args) as reference:
            report["agreement"] = agreement(ours, greedy_tokens(reference, prompts, args.agree_tokens))
    else:
        llm.shutdown()
    rows = [("quantization", "perplexity", "tokens", "greedy agreement")]
    agree = report.get("agreement")
    rows.append((str(report["quantization"] or "none"), f"{report['perplexity']:.4f}", str(report["tokens"]),
                 f"{agree['mean_tokens_to_divergence']}/{agree['out_of']} ({agree['full_agreement']} in full)"
                 if agree else "-"))
    print("\n".join(format_table(rows)))  # the table is the program's output, not a log
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    logger.info("wrote %s", path)
    return 0
