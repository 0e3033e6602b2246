"""``prefixserve bench latency``: step times at fixed batch sizes and lengths
(vLLM's ``bench latency``), with llama.cpp on the same weights as the
baseline measured in the same run (``--compare llama.cpp``).

For each batch size B: B prompts of ``--input-len`` random tokens are
prefilled (untimed), then ``--output-len`` decode steps run with all B
sequences in the batch; a step's time is one ``engine.step()`` (scheduling,
forward, sampling, detokenization: what a user waits for), and decode
tokens/s is B over the median step. Prefill: one prompt of
``--prefill-len`` tokens in one step, the median of ``--num-iters``. Every
prompt is fresh random tokens, so nothing is served from the prefix cache.

llama.cpp (``cluster/bench/llama_cpp_peer.py``; not a dependency: install
the wheel from ``../shared/peers``) runs the same token ids on a GGUF written
from the benchmarked model's own file (``--model``: the default model, a
packaged one such as ``gemma3-270m``, or a ``.gguf``; F32 by default: the
same float32 weights our engine computes with; ``--peer-weights file`` runs
the file itself, e.g. gemma3-270m's Q4_K_M), with as many threads as ours,
and its greedy output is checked against ours: llama.cpp reads the
vocabulary of that same file, so the token ids are ours.

With ``--compare``, decode steps of the two engines alternate, 8 of ours
then 8 of llama.cpp's (``--interleave-steps``), both batches alive all the
while: this machine's speed drifts by 10-40% over seconds to minutes, which
separate measurements turn into noise in the ratio and interleaving cancels.

``--profile`` adds a per-step breakdown (linear, attention, LM head,
sampler, the rest in Python) of a decode step at each batch size.

Prints a table, writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from cluster.bench.roofline import measure_read_gbps, median_gbps, roofline, step_cell
from cluster.bench.roofline import summary as roofline_summary
from cluster.client.table import format_table

logger = logging.getLogger(__name__)


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32], help="decode batch sizes")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens of each decoding sequence")
    parser.add_argument("--output-len", type=int, default=32, help="decode steps timed per batch size")
    parser.add_argument("--prefill-len", type=int, default=512, help="tokens of the timed prefill (0 skips)")
    parser.add_argument("--num-iters", type=int, default=3, help="prefills timed (median)")
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--compare", choices=["none", "llama.cpp"], default="none",
                        help="also run llama.cpp on the same weights and print the ratios")
    parser.add_argument("--peer-weights", choices=["f32", "q8_0", "file", "q4_1"], default="f32",
                        help="llama.cpp's GGUF: f32 (our weights), or a quantized one")
    parser.add_argument("--threads", type=int, default=None, help="threads of both engines (default: torch's)")
    parser.add_argument("--interleave-steps", type=int, default=8,
                        help="with --compare: decode steps of one engine before switching to the other, both "
                             "engines' batches alive at once (0: one engine's steps, then the other's)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="alternate both engines this many times and keep each figure's median "
                             "(evens out a machine whose speed drifts)")
    parser.add_argument("--profile", action="store_true", help="per-step time breakdown of a decode step")
    parser.add_argument("--roofline-tbps", type=float, default=None,
                        help="memory bandwidth in TB/s (e.g. 4.8 for an H200's HBM3e) for the weight-read "
                             "roofline printed next to each decode step (default on CPU: measured in each round)")
    parser.add_argument("--json", default="bench-results/latency.json", help="where to write the results")


def make_prompts(n: int, length: int, vocab_size: int, skip_ids: set[int], rng: random.Random) -> list[list[int]]:
    """``n`` prompts of ``length`` random tokens (special tokens left out)."""
    usable = [t for t in range(min(vocab_size, 32000)) if t not in skip_ids]
    return [[rng.choice(usable) for _ in range(length)] for _ in range(n)]


def engine_decode_steps(llm: Any, prompts: list[list[int]], num_steps: int) -> list[float]:
    """Seconds of each of ``num_steps`` decode steps with every prompt in the batch."""
    return list(engine_decode_step_iter(llm, prompts, num_steps))


def engine_decode_step_iter(llm: Any, prompts: list[list[int]], num_steps: int,
                            loras: Optional[list[Any]] = None) -> Iterator[float]:
    """``engine_decode_steps`` one step at a time (the prefill runs, untimed, before the first);
    ``loras``: each prompt's LoRA adapter (None: the base model)."""
    from cluster.shared.types import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=num_steps + 1, temperature=0.0, ignore_eos=True)
    loras = loras if loras is not None else [None] * len(prompts)
    requests = [llm.make_request(p, params, lora_request=lr) for p, lr in zip(prompts, loras, strict=True)]
    for req in requests:
        engine.add_request(req)
    started: set[str] = set()
    while len(started) < len(requests):  # prefill (maybe several steps), untimed
        started.update(out.request_id for out in engine.step() if out.new_token_ids)
    done = 0
    while engine.has_unfinished_requests():
        begin = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - begin
        assert all(len(o.new_token_ids) == 1 for o in outs), "every sequence decodes one token per step"
        if done < num_steps:
            done += 1
            yield elapsed


def interleaved_decode(ours: Iterator[float], theirs: Iterator[float], chunk: int) -> tuple[list[float], list[float]]:
    """Runs two engines' decode steps alternately, ``chunk`` steps of one, then
    ``chunk`` of the other, to the end of both: a machine whose speed drifts
    over seconds then slows both alike, and the ratio of the medians holds."""
    times: tuple[list[float], list[float]] = ([], [])
    iters = [ours, theirs]
    live = [True, True]
    while any(live):
        for which in (0, 1):
            for _ in range(chunk if live[which] else 0):
                step = next(iters[which], None)
                if step is None:
                    live[which] = False
                    break
                times[which].append(step)
    return times


def engine_prefill_seconds(llm: Any, prompt: list[int]) -> float:
    """Seconds until the first token of one fresh prompt (all its prefill steps)."""
    from cluster.shared.types import SamplingParams

    engine = llm.engine
    engine.add_request(llm.make_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    begin = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - begin


def run_latency(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    import torch

    from workers.builder import freeze_heap
    from workers.llm import LLM

    if engine_args.get("speculative_config") is not None:
        raise ValueError("bench latency times one-token decode steps: measure speculative decoding with "
                         "prefixserve bench spec --speculative-config ...")
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    max_batch = max(args.batch_sizes)
    engine_args = {"max_num_seqs": max(max_batch, 8),
                   "max_num_batched_tokens": max(2048, args.prefill_len, max_batch * args.input_len), **engine_args}
    load_start = time.perf_counter()
    llm = LLM(**engine_args)
    freeze_heap()  # one engine for this process's life
    load_s = time.perf_counter() - load_start
    vocab = llm.engine.vocab_size
    skip = set(llm.engine.scheduler.eos_token_ids) | {0, 1, 2}
    rng = random.Random(args.workload_seed)
    warm_start = time.perf_counter()
    engine_decode_steps(llm, make_prompts(max_batch, 16, vocab, skip, rng), 8)  # kernels built, caches warm
    warmup_s = time.perf_counter() - warm_start

    ours_rounds, peer_rounds, gbps_rounds = [], [], []
    measure_bandwidth = not args.roofline_tbps and str(getattr(llm.runner, "device", "cpu")).startswith("cpu")
    for round_index in range(max(1, args.rounds)):
        logger.info("round %d of %d", round_index + 1, args.rounds)
        if measure_bandwidth:  # in each round: the floor drifts with the machine
            gbps_rounds.append(measure_read_gbps())
        # Fresh prompts each round: nothing comes from the prefix cache.
        workload = {b: make_prompts(b, args.input_len, vocab, skip, rng) for b in args.batch_sizes}
        prefill_prompts = make_prompts(args.num_iters, args.prefill_len, vocab, skip, rng) if args.prefill_len else []
        if args.compare == "llama.cpp" and args.interleave_steps > 0:
            ours, theirs = _measure_interleaved(llm, workload, prefill_prompts, args, threads)
            ours_rounds.append(ours)
            peer_rounds.append(theirs)
            continue
        ours_rounds.append(_measure_ours(llm, workload, prefill_prompts, args))
        if args.compare == "llama.cpp":
            peer_rounds.append(_measure_llama_cpp(llm, workload, prefill_prompts, args, threads))
    report: dict[str, Any] = {
        "model": str(llm.model_dir), "threads": threads, "rounds": len(ours_rounds),
        "engine_args": {k: str(v) for k, v in engine_args.items()},
        "load_seconds": round(load_s, 2), "warmup_seconds": round(warmup_s, 2),
        "prefixserve": median_of_rounds(ours_rounds),
        "device": llm.runner.description, "weight_bytes": llm.runner.weight_bytes,
        "interleave_steps": args.interleave_steps if args.compare == "llama.cpp" else 0,
    }
    if peer_rounds:
        report["llama.cpp"] = {**median_of_rounds(peer_rounds), "weights": peer_rounds[0]["weights"],
                               "gguf": peer_rounds[0]["gguf"], "greedy_agreement": peer_rounds[0]["greedy_agreement"]}
    if args.roofline_tbps or gbps_rounds:
        peer = (report["llama.cpp"]["decode"], Path(report["llama.cpp"]["gguf"]).stat().st_size) if peer_rounds \
            else None  # llama.cpp reads its whole file a step (the tied embedding is its LM head)
        gbps = args.roofline_tbps * 1e3 if args.roofline_tbps else median_gbps(gbps_rounds)
        report["roofline"] = roofline(report["prefixserve"]["decode"], llm.runner.weight_bytes, gbps,
                                      measured=not args.roofline_tbps, peer=peer, gbps_rounds=gbps_rounds)
    if args.profile:
        from cluster.bench.step_profile import profile_decode_step

        report["profile"] = {str(b): profile_decode_step(llm, workload[b]) for b in args.batch_sizes}
    print("\n".join(format_report(report)))  # the table is the program's output, not a log
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    logger.info("wrote %s", path)
    llm.shutdown()
    return 0


def median_of_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds (``decode`` per batch size, ``prefill``)."""
    out: dict[str, Any] = {"decode": {}}
    for batch in rounds[0]["decode"]:
        steps = [r["decode"][batch]["step_ms"] for r in rounds]
        step = statistics.median(steps)
        out["decode"][batch] = {"step_ms": round(step, 2), "tokens_per_s": round(int(batch) * 1e3 / step, 2),
                                "step_ms_rounds": steps}
    if "prefill" in rounds[0]:
        secs = statistics.median(r["prefill"]["seconds"] for r in rounds)
        tokens = rounds[0]["prefill"]["tokens"]
        out["prefill"] = {"tokens": tokens, "seconds": round(secs, 4), "tokens_per_s": round(tokens / secs, 1)}
    return out


def _measure_ours(llm: Any, workload: dict[int, list[list[int]]], prefill_prompts: list[list[int]],
                  args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"decode": {}}
    for batch, prompts in workload.items():
        out["decode"][str(batch)] = fig = _decode_figures(batch, engine_decode_steps(llm, prompts, args.output_len))
        logger.info("prefixserve batch %d: %.1f ms/step, %.1f tok/s", batch, fig["step_ms"], fig["tokens_per_s"])
    if prefill_prompts:
        secs = statistics.median(engine_prefill_seconds(llm, p) for p in prefill_prompts)
        out["prefill"] = {"tokens": len(prefill_prompts[0]), "seconds": round(secs, 4),
                          "tokens_per_s": round(len(prefill_prompts[0]) / secs, 1)}
        logger.info("prefixserve prefill %d tokens: %.3f s", len(prefill_prompts[0]), secs)
    return out


def _decode_figures(batch: int, times: list[float]) -> dict[str, float]:
    step = statistics.median(times)
    return {"step_ms": round(step * 1e3, 2), "tokens_per_s": round(batch / step, 2),
            "step_ms_min": round(min(times) * 1e3, 2)}


def _measure_interleaved(llm: Any, workload: dict[int, list[list[int]]], prefill_prompts: list[list[int]],
                         args: argparse.Namespace, threads: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One round with llama.cpp, the decode steps of both engines interleaved
    (``interleaved_decode``); prefill as in ``_measure_ours`` / llama.cpp's own."""
    from cluster.bench import llama_cpp_peer

    gguf = peer_file(llm.config.model, args.peer_weights)
    ours = _measure_ours(llm, {}, prefill_prompts, args)
    longest = max([len(p) for p in prefill_prompts]
                  + [len(p) + args.output_len for ps in workload.values() for p in ps])
    # One llama.cpp context for the round: prefill, the greedy check and every batch size.
    with llama_cpp_peer.LlamaCppPeer(gguf, n_threads=threads, n_ctx=max(1024, longest),
                                     n_seq_max=max([32, *workload]),
                                     n_batch=max([512, *(len(p) for p in prefill_prompts)])) as peer:
        theirs = _measure_llama_cpp(llm, {}, prefill_prompts, args, threads,
                                    check_prompt=next(iter(workload.values()))[0], peer=peer)
        for batch, prompts in workload.items():
            mine, other = interleaved_decode(engine_decode_step_iter(llm, prompts, args.output_len),
                                             peer.decode_steps(prompts, args.output_len), args.interleave_steps)
            ours["decode"][str(batch)] = _decode_figures(batch, mine)
            theirs["decode"][str(batch)] = _decode_figures(batch, other)
            logger.info("batch %d, interleaved every %d steps: prefixserve %.1f ms, llama.cpp %.1f ms a step", batch,
                        args.interleave_steps, statistics.median(mine) * 1e3, statistics.median(other) * 1e3)
    return ours, theirs


def _measure_llama_cpp(llm: Any, workload: dict[int, list[list[int]]], prefill_prompts: list[list[int]],
                       args: argparse.Namespace, threads: int, check_prompt: Optional[list[int]] = None,
                       peer: Any = None) -> dict[str, Any]:
    """llama.cpp's figures for ``workload`` (may be empty: prefill only) and its
    greedy agreement with ours on ``check_prompt`` (default the first prompt),
    on ``peer`` when given (else on contexts opened here)."""
    from cluster.bench import llama_cpp_peer, peer_weights
    from cluster.shared.types import SamplingParams

    gguf = peer_file(llm.config.model, args.peer_weights)
    first = check_prompt if check_prompt is not None else next(iter(workload.values()))[0]
    ours = llm.generate([first], SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0].token_ids
    prefill = prefill_prompts[0] if prefill_prompts else first
    raw = llama_cpp_peer.measure(gguf, workload, args.output_len, prefill, n_threads=threads, peer=peer)
    if peer is not None:
        theirs = peer.greedy(first, 32)
    else:
        with llama_cpp_peer.LlamaCppPeer(gguf, n_threads=threads) as opened:
            theirs = opened.greedy(first, 32)
    agree = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    result: dict[str, Any] = {
        "weights": peer_weights.gguf_file_type(gguf), "gguf": raw["gguf"], "greedy_agreement": f"{agree}/32",
        "decode": {str(d["batch_size"]): {"step_ms": round(d["median_step_s"] * 1e3, 2),
                                          "tokens_per_s": round(d["decode_tokens_per_s"], 2)} for d in raw["decode"]},
    }
    if prefill_prompts:
        result["prefill"] = {"tokens": raw["prefill"]["tokens"], "seconds": round(raw["prefill"]["seconds"], 4),
                             "tokens_per_s": round(raw["prefill"]["tokens_per_s"], 1)}
    return result


def peer_file(model: Any, kind: str) -> Path:
    """llama.cpp's GGUF of ``kind`` (``--peer-weights``) for our ``--model``
    (None: the default model): the model's own GGUF file, or a file made from it.

    Raises:
        ValueError: If the model is a checkpoint folder: llama.cpp needs its GGUF.
    """
    from cluster.bench import peer_weights
    from cluster.shared.cache import cache_root
    from workers.model.loader import model_gguf_path

    src = model_gguf_path(model)
    if src is None:
        raise ValueError(f"--compare llama.cpp runs llama.cpp on the model's GGUF file, and {model} is not one: "
                         "pass a .gguf file, a packaged model (e.g. --model gemma3-270m) or no --model")
    return peer_weights.peer_gguf(kind, cache_root(), src=src)


def format_report(report: dict[str, Any]) -> list[str]:
    """The table: one row per figure, ours, llama.cpp's and the ratio when compared."""
    ours, peer = report["prefixserve"], report.get("llama.cpp")
    line = report.get("roofline")
    header = ("figure", "prefixserve") + (("llama.cpp " + peer["weights"], "ratio") if peer else ()) \
        + (("weight-read roofline",) if line else ())
    rows = [header]

    def add(name: str, mine: Optional[float], theirs: Optional[float], unit: str, higher_better: bool,
            roof: str = "") -> None:
        cells = [name, f"{mine:.1f} {unit}" if mine is not None else "-"]
        if peer:
            cells.append(f"{theirs:.1f} {unit}" if theirs is not None else "-")
            if mine and theirs:
                cells.append(f"{(mine / theirs if higher_better else theirs / mine):.2f}x")
            else:
                cells.append("-")
        rows.append(tuple(cells) + ((roof,) if line else ()))

    for batch, fig in ours["decode"].items():
        other = peer["decode"].get(batch) if peer else None
        add(f"decode batch {batch}", fig["tokens_per_s"], other and other["tokens_per_s"], "tok/s", True)
        add(f"  step batch {batch}", fig["step_ms"], other and other["step_ms"], "ms", False, step_cell(line, batch))
    if "prefill" in ours:
        fig = ours["prefill"]
        other = peer.get("prefill") if peer else None
        add(f"prefill {fig['tokens']} tokens", fig["tokens_per_s"], other and other["tokens_per_s"], "tok/s", True)
    lines = format_table(rows)
    lines.append(f"load {report['load_seconds']} s, warm-up {report['warmup_seconds']} s, {report['threads']} threads, "
                 f"median of {report['rounds']} round(s)"
                 + (f"; decode steps interleaved with llama.cpp's, {report['interleave_steps']} at a time"
                    if peer and report.get("interleave_steps") else "")
                 + (f"; greedy agreement with llama.cpp: {peer['greedy_agreement']}" if peer else ""))
    if line:
        lines.append(roofline_summary(line))
    for batch, parts in (report.get("profile") or {}).items():
        lines.append(f"decode step, batch {batch}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in parts.items()))
    return lines
