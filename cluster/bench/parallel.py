"""``prefixserve bench parallel``: parallel sampling (``n``) against the same
samples sent as separate requests, on one loaded model, in one run.

One prompt of ``--input-len`` random tokens, ``--n`` samples of
``--output-len`` tokens at ``--temperature`` (seeded: sample i with seed
``seed + i``), four ways per round:

* ``n=1``: one sample alone, the TTFT baseline;
* ``n=N``: one request with ``n = N`` (the prompt prefilled once, its KV
  shared by the N choices);
* ``separate, cache off``: N requests at once on an engine without prefix
  caching (each prefills the prompt);
* ``separate, cache on``: N requests at once with prefix caching (the first
  prefills, the others start from its blocks; the cache is reset first).

Per way: TTFT (first token of every choice), end-to-end time, and the peak
of used KV blocks (read from the block pool after every step), against the
bound of one prompt plus N outputs. The N samples of every way must be the
same tokens (``identical``). With ``--rounds`` R the ways run R times in turn
(odd rounds in reverse order) and medians are kept, so a machine's drift hits
all alike. Prints a table and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from pathlib import Path
from typing import Any

from cluster.client.table import format_table
from cluster.shared.sizes import cdiv

logger = logging.getLogger(__name__)

WAYS = ("n=1", "n=N", "separate, cache off", "separate, cache on")


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens")
    parser.add_argument("--n", type=int, default=8, help="samples of the prompt")
    parser.add_argument("--output-len", type=int, default=64, help="tokens per sample")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--rounds", type=int, default=3, help="runs of every way; medians are kept")
    parser.add_argument("--json", default="bench-results/parallel.json", help="where to write the results")


def _run(llm: Any, prompt: list[int], params: list[Any]) -> dict[str, Any]:
    """Runs ``params`` (one request each) over ``prompt`` to the end: TTFT of the
    last choice's first token, end-to-end seconds, peak used blocks, the samples."""
    engine = llm.engine
    pool = engine.scheduler.kv_manager.device_pool
    requests = [llm.make_request(prompt, p) for p in params]
    outputs = {(r.request_id, i): [] for r in requests for i in range(r.sampling_params.num_choices)}
    started = time.perf_counter()
    for request in requests:
        engine.add_request(request)
    ttft, peak = None, pool.num_used_blocks
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[(out.request_id, out.index)].extend(out.new_token_ids)
        peak = max(peak, pool.num_used_blocks)
        if ttft is None and all(outputs.values()):
            ttft = time.perf_counter() - started
    return {"ttft_s": ttft, "e2e_s": time.perf_counter() - started, "peak_blocks": peak,
            "samples": [outputs[key] for key in sorted(outputs, key=lambda k: (requests.index(
                next(r for r in requests if r.request_id == k[0])), k[1]))]}


def run_parallel(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    from cluster.shared.types import SamplingParams
    from workers.llm import LLM

    n, length, out_len = args.n, args.input_len, args.output_len
    base = {"max_num_seqs": max(16, n), "max_num_batched_tokens": max(2048, length + 64), **engine_args}
    base.pop("enable_prefix_caching", None)
    logger.info("loading the model twice: prefix caching on and off")
    cached = LLM(**base, enable_prefix_caching=True)
    uncached = LLM(**base, enable_prefix_caching=False)
    skip = set(cached.engine.scheduler.eos_token_ids) | {0, 1, 2}
    rng = random.Random(0)
    prompt = [t for t in (rng.randrange(cached.engine.vocab_size) for _ in range(4 * length)) if t not in skip][:length]

    def sample(seed: int, choices: int = 1) -> Any:
        return SamplingParams(max_tokens=out_len, temperature=args.temperature, seed=seed, n=choices, ignore_eos=True)

    ways = {
        "n=1": (cached, [sample(0)]),
        "n=N": (cached, [sample(0, n)]),
        "separate, cache off": (uncached, [sample(i) for i in range(n)]),
        "separate, cache on": (cached, [sample(i) for i in range(n)]),
    }
    for llm in (cached, uncached):  # warm-up: kernels built, allocator warm
        _run(llm, prompt[:64], [sample(0, 2)])
    runs: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
    for round_index in range(max(1, args.rounds)):
        for way in WAYS[:: -1 if round_index % 2 else 1]:
            llm, params = ways[way]
            llm.engine.scheduler.kv_manager.reset_prefix_cache()  # every way starts from a cold prompt
            logger.info("round %d: %s", round_index + 1, way)
            runs[way].append(_run(llm, prompt, params))
    block_size = cached.engine.scheduler.kv_manager.block_size
    bound = cdiv(length, block_size) + n * cdiv(length % block_size + out_len, block_size)
    reference = runs["separate, cache off"][0]["samples"]
    report: dict[str, Any] = {"model": str(cached.model_dir), "input_len": length, "n": n, "output_len": out_len,
                              "temperature": args.temperature, "block_size": block_size, "rounds": max(1, args.rounds),
                              "peak_blocks_bound": bound, "ways": {}}
    for way in WAYS:
        results = runs[way]
        entry = {key: statistics.median(r[key] for r in results) for key in ("ttft_s", "e2e_s")}
        entry["peak_blocks"] = max(r["peak_blocks"] for r in results)
        if way != "n=1":
            entry["identical"] = all(r["samples"] == reference for r in results)
        else:
            entry["identical"] = all(r["samples"] == reference[:1] for r in results)
        report["ways"][way] = entry
    ways_fig = report["ways"]
    report["ttft_n_over_n1"] = ways_fig["n=N"]["ttft_s"] / ways_fig["n=1"]["ttft_s"]
    report["speedup_vs_separate_cache_off"] = ways_fig["separate, cache off"]["e2e_s"] / ways_fig["n=N"]["e2e_s"]
    report["speedup_vs_separate_cache_on"] = ways_fig["separate, cache on"]["e2e_s"] / ways_fig["n=N"]["e2e_s"]
    print("\n".join(format_report(report)))  # the table is the program's output
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    logger.info("wrote %s", path)
    for llm in (cached, uncached):
        llm.shutdown()
    return 0


def format_report(report: dict[str, Any]) -> list[str]:
    n = report["n"]
    rows = [("way", "TTFT ms", "e2e ms", "e2e / n=N", "peak blocks", "same samples")]
    base = report["ways"]["n=N"]["e2e_s"]
    for way, fig in report["ways"].items():
        rows.append((way.replace("N", str(n)), f"{1e3 * fig['ttft_s']:.1f}", f"{1e3 * fig['e2e_s']:.1f}",
                     f"{fig['e2e_s'] / base:.2f}x", str(fig["peak_blocks"]), "yes" if fig["identical"] else "NO"))
    lines = format_table(rows)
    lines.append(f"prompt {report['input_len']} tokens, {n} samples of {report['output_len']} at T="
                 f"{report['temperature']}; peak bound (one prompt + {n} outputs): {report['peak_blocks_bound']} "
                 f"blocks of {report['block_size']}")
    lines.append(f"TTFT n={n} / n=1: {report['ttft_n_over_n1']:.2f}x; n={n} is "
                 f"{report['speedup_vs_separate_cache_off']:.2f}x faster than separate requests without prefix "
                 f"caching, {report['speedup_vs_separate_cache_on']:.2f}x with it")
    return lines
