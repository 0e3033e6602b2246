"""``prefixserve bench quant``: every quantization of the default model on one
table, measured in one run: perplexity on held-out text, greedy agreement with
the float run, weight bytes, decode tokens/s at batch 1 and with 8 sequences,
prefill tokens/s; and llama.cpp on the same model's Q8_0 and Q4_1 GGUF files
when ``llama_cpp`` is importable (``--peers``; not a dependency).

    prefixserve bench quant
    prefixserve bench quant --methods none gguf int4-g32 --peers q4_1 --rounds 3

Methods: ``none`` (float32), ``w8a8``, ``int8``, ``int4-g32`` / ``int4-g64`` /
``int4-g128``, ``gguf``, ``gguf-a8`` (the file's tensors on int8 activations), ``gptq`` / ``awq`` (the default model written as a
group-128 checkpoint as ``prefixserve quantize`` does, GPTQ and AWQ calibrated
on 4096 tokens, once, into the cache; see ``workers/model/quant/``), and ``kv-int8``
(float weights, ``kv_cache_dtype="int8"``; its perplexity is computed in
prefill chunks of 64 tokens so that tokens attend to the int8 cache; the KV
block bytes column shows what each block costs). Speed figures use the
same steps as ``bench latency`` (fresh random prompts, nothing from the prefix
cache); with ``--rounds`` N the speed part runs N times over all methods and
peers in turn and reports medians, so drift of a shared machine hits every
column alike. Ratios are the median over rounds of each round's ratio
against the float run of that round. The roofline column sets the first
batch size's step against one read of the row's weights (llama.cpp: its
file) at the read bandwidth measured right before that row's steps
(``roofline.py``). The llama.cpp columns set each row against llama.cpp on
the file of its kind (``PEER_OF``: ``gguf`` / ``gguf-a8`` run the very Q4_1
file llama.cpp runs; ``w8a8`` / ``int8`` are set against its Q8_0,
``int4-g*`` against its Q4_1), per round as well. Prefill: the median of
``--prefill-reps`` fresh prompts (llama.cpp's side: the median of 3 after a
warm-up).

Prints a table and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import statistics
from pathlib import Path
from typing import Any, Optional

from cluster.bench.roofline import measure_read_gbps
from cluster.client.table import format_table

logger = logging.getLogger(__name__)

METHODS = ("none", "w8a8", "int8", "int4-g32", "int4-g64", "int4-g128", "gguf", "gguf-a8", "gptq", "awq", "kv-int8")
CHECKPOINT_GROUP = 128  # gptq / awq checkpoints written for the table (their usual group size)
KV_PPL_CHUNK = 64  # prefill chunk of kv-int8's perplexity: tokens attend to cached (quantized) keys
PEERS = ("q8_0", "q4_1")
# The llama.cpp file each method is set against: the same file (gguf), or the same bits a weight.
PEER_OF = {"gguf": "q4_1", "gguf-a8": "q4_1", "int4-g32": "q4_1", "int4-g64": "q4_1", "int4-g128": "q4_1",
           "w8a8": "q8_0", "int8": "q8_0"}


def add_quant_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--methods", nargs="+",
                        default=["none", "w8a8", "int8", "int4-g32", "int4-g128", "gguf", "gguf-a8"],
                        choices=METHODS, help="what to measure (none = float32)")
    parser.add_argument("--peers", nargs="*", default=list(PEERS), choices=PEERS,
                        help="llama.cpp GGUF types to measure too (skipped without llama_cpp)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=24, help="decode steps timed per batch size")
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--prefill-reps", type=int, default=3, help="prefills timed per round (median)")
    parser.add_argument("--rounds", type=int, default=1, help="speed rounds over every method (medians)")
    parser.add_argument("--ppl-tokens", type=int, default=4096, help="held-out tokens of the perplexity")
    parser.add_argument("--num-prompts", type=int, default=20, help="prompts of the greedy agreement")
    parser.add_argument("--agree-tokens", type=int, default=32)
    parser.add_argument("--json", default="bench-quant.json")


def method_args(method: str) -> dict[str, Any]:
    """Engine arguments of a method name (``int4-g32`` -> int4 with groups of 32)."""
    if method == "none":
        return {}
    if method == "kv-int8":
        return {"kv_cache_dtype": "int8"}
    if method in ("gptq", "awq"):
        return {"model": str(_checkpoint(method))}
    if method.startswith("int4-g"):
        return {"quantization": "int4", "quantization_group_size": int(method.removeprefix("int4-g"))}
    return {"quantization": method}


def run_quant(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    from cluster.bench.evaluate import agreement, agreement_prompts, greedy_tokens, perplexity
    from cluster.bench.latency import engine_decode_steps, engine_prefill_seconds, make_prompts
    from workers.llm import LLM

    if engine_args.get("model") is not None or "quantization" in engine_args:
        raise ValueError("bench quant runs the default model once per --methods entry: drop --model/--quantization")
    base = {"max_num_seqs": max(8, *args.batch_sizes), "max_num_batched_tokens": max(2048, args.prefill_len),
            **engine_args}
    peers = _available_peers(args.peers)
    rng = random.Random(0)
    results: dict[str, dict[str, Any]] = {}
    reference: Optional[list[list[int]]] = None
    speed_rounds: dict[str, list[dict[str, Any]]] = {m: [] for m in [*args.methods, *peers]}
    workloads = []
    for round_index in range(max(1, args.rounds)):
        workloads.append(None)
        for method in args.methods:
            logger.info("round %d: %s", round_index + 1, method)
            with LLM(**base, **method_args(method)) as llm:
                if workloads[-1] is None:
                    vocab, skip = llm.engine.vocab_size, set(llm.engine.scheduler.eos_token_ids) | {0, 1, 2}
                    workloads[-1] = ({b: make_prompts(b, args.input_len, vocab, skip, rng) for b in args.batch_sizes},
                                     make_prompts(max(1, args.prefill_reps), args.prefill_len, vocab, skip, rng))
                decode_sets, prefill_prompts = workloads[-1]
                if round_index == 0:
                    row = results.setdefault(method, {})
                    row["weight_bytes"] = int(llm.runner.weight_bytes)
                    row["quantization"] = llm.runner.quantization or "none"
                    row["kv_cache_blocks"] = int(llm.runner.num_kv_blocks)
                    row["kv_block_bytes"] = int(llm.runner.kv_cache_bytes // llm.runner.num_kv_blocks)
                    if method == "kv-int8":
                        # A window prefilled in one step attends to its own float keys; in
                        # chunks, each chunk attends to the cached (int8) keys before it.
                        chunked = {**base, **method_args(method), "max_num_batched_tokens": KV_PPL_CHUNK,
                                   "max_num_seqs": KV_PPL_CHUNK}
                        with LLM(**chunked) as ppl_llm:
                            row.update(perplexity(ppl_llm, 512, args.ppl_tokens))
                        row["perplexity_prefill_chunk"] = KV_PPL_CHUNK
                    else:
                        row.update(perplexity(llm, 512, args.ppl_tokens))
                    prompts = agreement_prompts(llm, args.num_prompts)
                    tokens = greedy_tokens(llm, prompts, args.agree_tokens)
                    reference = reference if reference is not None else (tokens if method == "none" else None)
                    row["_tokens"] = tokens
                engine_decode_steps(llm, decode_sets[args.batch_sizes[0]][:1], 4)  # warm
                speed: dict[str, Any] = {"gbps": measure_read_gbps()}  # the roofline's rate, this minute
                for batch, prompts in decode_sets.items():
                    speed[f"decode_b{batch}"] = batch / statistics.median(
                        engine_decode_steps(llm, prompts, args.output_len))
                # fresh prompts: a repeated one would be served from the prefix cache
                speed["prefill"] = args.prefill_len / statistics.median(
                    engine_prefill_seconds(llm, prompt) for prompt in prefill_prompts)
                speed_rounds[method].append(speed)
                logger.info("%s: %s", method, {k: round(v, 1) for k, v in speed.items()})
            gc.collect()
        for peer in peers:
            decode_sets, prefill_prompts = workloads[-1]
            speed_rounds[peer].append(_peer_speed(peer, decode_sets, prefill_prompts[0], args.output_len))
        agreements = {m: agreement(results[m]["_tokens"], reference) for m in args.methods} if reference else {}
        report = build_report(results, agreements, speed_rounds, peers)
        report.update(engine_args={k: str(v) for k, v in base.items()}, batch_sizes=args.batch_sizes)
        _write(report, Path(args.json))  # after every round: a run cut short keeps the rounds it finished
    print("\n".join(format_report(report)))  # the table is the program's output, not a log
    return 0


def build_report(results: dict[str, dict[str, Any]], agreements: dict[str, Any],
                 speed_rounds: dict[str, list[dict[str, Any]]], peers: list[str]) -> dict[str, Any]:
    """The report of the rounds so far (``results`` untouched): per row its round-1 figures, its agreement,
    the medians of its speed rounds and the paired ratios."""
    out = {name: {k: v for k, v in row.items() if k != "_tokens"} for name, row in results.items()}
    for method, agree in agreements.items():
        out[method]["agreement"] = agree
    for name, rounds in speed_rounds.items():
        row = out.setdefault(name, {"quantization": f"llama.cpp {name.upper()}"})
        row.update({k: round(statistics.median(r[k] for r in rounds), 2) for k in rounds[0]})
    add_ratios(out, speed_rounds, peers)
    return {"rounds": len(next(iter(speed_rounds.values()))), "results": out}


def _write(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(path)
    logger.info("wrote %s (%d round(s))", path, report["rounds"])


def add_ratios(results: dict[str, dict[str, Any]], speed_rounds: dict[str, list[dict[str, Any]]],
               peers: list[str]) -> None:
    """Each row's ``vs_float32`` and (with its llama.cpp file measured) ``vs_llama_cpp``, paired by round."""
    for name, rounds in speed_rounds.items():
        if name != "none" and "none" in speed_rounds:
            results[name]["vs_float32"] = paired_ratios(rounds, speed_rounds["none"])
        peer = PEER_OF.get(name)
        if peer in peers:
            results[name]["vs_llama_cpp"] = {"peer": peer, **paired_ratios(rounds, speed_rounds[peer])}


def paired_ratios(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> dict[str, float]:
    """Per speed figure (``decode_b*``, ``prefill``): the median over rounds of ours / theirs in that round."""
    keys = [k for k in ours[0] if (k.startswith("decode_b") or k == "prefill") and k in theirs[0]]
    return {k: round(statistics.median(a[k] / b[k] for a, b in zip(ours, theirs, strict=True)), 3) for k in keys}


def _checkpoint(method: str) -> Path:
    """The default model as a ``method`` checkpoint (``prefixserve quantize``), written once into the cache."""
    from cluster.shared.cache import cache_root
    from workers.model.loader import resolve_model
    from workers.quantize import quantize_checkpoint

    # "calibrated": written by GPTQ / AWQ themselves (earlier versions rounded to nearest)
    folder = cache_root() / "quantized" / f"default-{method}-g{CHECKPOINT_GROUP}-calibrated"
    if not (folder / "config.json").is_file():
        tmp = folder.with_name(folder.name + ".tmp")
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp)
        quantize_checkpoint(resolve_model(None), tmp, method, CHECKPOINT_GROUP)
        tmp.rename(folder)
    return folder


def _available_peers(wanted: list[str]) -> list[str]:
    if not wanted:
        return []
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        logger.warning("llama_cpp is not importable: no llama.cpp columns (see the peers README)")
        return []
    return list(wanted)


def _peer_speed(peer: str, decode_sets: dict[int, list[list[int]]], prefill_prompt: list[int],
                output_len: int) -> dict[str, float]:
    import torch

    from cluster.bench import llama_cpp_peer, peer_weights
    from cluster.shared.cache import cache_root

    gguf = peer_weights.peer_gguf(peer, cache_root())
    gbps = measure_read_gbps()
    raw = llama_cpp_peer.measure(gguf, decode_sets, output_len, prefill_prompt, n_threads=torch.get_num_threads())
    speed = {f"decode_b{d['batch_size']}": d["decode_tokens_per_s"] for d in raw["decode"]}
    speed.update(gbps=gbps, weight_bytes=gguf.stat().st_size)  # llama.cpp reads its whole file a step
    speed["prefill"] = raw["prefill"]["tokens_per_s"]
    return speed


def format_report(report: dict[str, Any]) -> list[str]:
    batches = report["batch_sizes"]
    results = report["results"]
    base = results.get("none", {})
    header = ["method", "perplexity", "greedy agreement", "weights MiB", "KV block KiB",
              *[f"decode b{b} tok/s" for b in batches], f"b{batches[0]} roofline", "prefill tok/s",
              "vs llama.cpp: " + " / ".join([*[f"b{b}" for b in batches], "prefill"])]
    rows = [tuple(header)]

    def with_ratio(row: dict[str, Any], key: str) -> str:
        value = row.get(key)
        if value is None:
            return "-"
        ratio = row.get("vs_float32", {}).get(key)  # paired per round; else the medians' ratio
        ref = base.get(key)
        ratio = ratio if ratio is not None else (value / ref if ref else None)
        return f"{value:.1f} ({ratio:.2f}x)" if ratio is not None else f"{value:.1f}"

    for name, row in results.items():
        agree = row.get("agreement")
        label = {"none": "float32", "kv-int8": "float32, int8 KV"}.get(name, row.get("quantization", name))
        rows.append((
            label,
            f"{row['perplexity']:.3f}" if "perplexity" in row else "-",
            f"{agree['mean_tokens_to_divergence']:.1f}/{agree['out_of']} ({agree['full_agreement']})" if agree else "-",
            f"{row['weight_bytes'] / 2**20:.0f}" if "weight_bytes" in row else "-",
            f"{row['kv_block_bytes'] / 2**10:.0f}" if "kv_block_bytes" in row else "-",
            *[with_ratio(row, f"decode_b{b}") for b in batches],
            roofline_cell(row, batches[0]),
            with_ratio(row, "prefill"),
            peer_cell(row, batches),
        ))
    lines = format_table(rows)
    lines.append(f"speed: median of {report['rounds']} round(s); (x) = against float32 in the same run; "
                 "agreement = mean greedy tokens before the first divergence from float32 (prompts in full); "
                 "roofline = the weights' read time at the read bandwidth measured before that row's steps "
                 "(GB/s in brackets) over the step; vs llama.cpp = ours / llama.cpp on the file named, "
                 "median of the rounds' ratios")
    return lines


def peer_cell(row: dict[str, Any], batches: list[int]) -> str:
    """``Q4_1 1.37x / 1.73x / 0.95x``: the row against its llama.cpp file, per batch size and prefill."""
    vs = row.get("vs_llama_cpp")
    if not vs:
        return "-"
    keys = [*[f"decode_b{b}" for b in batches], "prefill"]
    return vs["peer"].upper() + " " + " / ".join(f"{vs[k]:.2f}x" if k in vs else "-" for k in keys)


def roofline_cell(row: dict[str, Any], batch: int) -> str:
    """``4.4 ms: 63% (25.1 GB/s)``: the weight-read floor of a step and the fraction of it reached."""
    gbps, rate, weight_bytes = row.get("gbps"), row.get(f"decode_b{batch}"), row.get("weight_bytes")
    if not (gbps and rate and weight_bytes):
        return "-"
    floor_ms = weight_bytes / (gbps * 1e9) * 1e3
    return f"{floor_ms:.1f} ms: {floor_ms * rate / batch / 1e3:.0%} ({gbps:.1f} GB/s)"
