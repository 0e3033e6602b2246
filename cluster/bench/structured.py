"""``prefixserve bench structured``: what structured outputs cost and gain on
one loaded model, in one run (modes alternate every round, odd rounds in
reverse order, so the machine's drift hits them alike).

Cases (greedy; prompts in the model's chat template):

* ``mask``: B requests decoding a JSON answer (one free string field, jump-
  forward off) against the same B requests unconstrained: the step time of
  steps where all B sequences decode (median), i.e. decode TPOT, and their
  ratio: what masks cost when every row is constrained;
* ``one-of-b``: B - 1 unconstrained requests beside one constrained one,
  against B unconstrained: the step time of steps with B decodes, i.e. what
  one constrained request costs the others;
* ``jump-forward``: extraction into a schema with fixed keys, jump-forward on
  against masked decoding alone, at batch 1 and B: decode tokens/s (tokens
  after each sequence's first over the time they took) and whether the
  outputs are the same token for token;
* ``compile``: milliseconds to compile a schema cold (every schema distinct,
  vLLM's ``json-unique``) and from the cache.

Prints a table and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any, Optional

from cluster.client.table import format_table

logger = logging.getLogger(__name__)

EXTRACT_KEYS = ["name", "age", "city", "country", "occupation", "email"]
EXTRACT_SCHEMA = {"type": "object", "additionalProperties": False, "required": EXTRACT_KEYS,
                  "properties": {k: ({"type": "integer"} if k == "age" else {"type": "string"}) for k in EXTRACT_KEYS}}
PEOPLE = ["Ann, 34, a nurse from Lyon, France (ann@example.com)", "Bob, 51, a baker in Austin, USA, bob@mail.com",
          "Chen, 28, engineer, Shanghai, China, chen@corp.cn", "Dana, 45, teacher in Oslo, Norway",
          "Eve, 22, student, Berlin, Germany, eve@uni.de", "Faisal, 39, doctor in Cairo, Egypt",
          "Gina, 60, retired pilot from Rome, Italy", "Hugo, 31, chef in Madrid, Spain, hugo@food.es"]
TOPICS = ["the sea", "a lighthouse keeper", "a city at night", "an old map", "a robot gardener", "winter",
          "a train journey", "a lost key"]
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
                 "additionalProperties": False}


def add_structured_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=8, help="B: the batch of the mask and one-of-b cases")
    parser.add_argument("--output-len", type=int, default=64, help="most tokens per sequence")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every case; medians are kept")
    parser.add_argument("--num-schemas", type=int, default=16, help="schemas of the compile case")
    parser.add_argument("--json", default="bench-results/structured.json", help="where to write the results")


def _chat(llm: Any, text: str) -> list[int]:
    return llm.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def _params(so: Optional[dict], output_len: int, ignore_eos: bool = False) -> Any:
    from cluster.shared.structured import StructuredOutputsParams
    from cluster.shared.types import SamplingParams

    return SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=ignore_eos and so is None,
                          structured_outputs=StructuredOutputsParams(**so) if so else None)


def run_batch(llm: Any, prompts: list[list[int]], params: list[Any], batch: int) -> dict[str, Any]:
    """Runs the requests to the end; returns the step times of steps with
    ``batch`` decoding sequences, decode tokens/s and the outputs' tokens."""
    engine = llm.engine
    requests = [llm.make_request(p, sp) for p, sp in zip(prompts, params)]
    grammars = llm._compile_grammars(requests)  # untimed: compiling is the compile case's
    for request, grammar in zip(requests, grammars):
        engine.add_request(request, grammar)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    full_steps: list[float] = []
    decode_tokens, decode_seconds = 0, 0.0
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - started
        decodes = sum(1 for out in outputs if tokens[out.request_id] and out.new_token_ids)
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
        if decodes == len(outputs) and decodes:
            decode_seconds += seconds
            decode_tokens += sum(len(o.new_token_ids) for o in outputs)
            if decodes == batch:
                full_steps.append(seconds)
    return {"step_s": statistics.median(full_steps) if full_steps else None, "num_full_steps": len(full_steps),
            "tokens_per_s": decode_tokens / decode_seconds if decode_seconds else 0.0,
            "outputs": [tokens[r.request_id] for r in requests]}


def _alternate(rounds: int, modes: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in modes}
    for r in range(rounds):
        for name in (list(modes) if r % 2 == 0 else list(reversed(modes))):
            results[name].append(modes[name]())
    return results


def _median(runs: list[dict[str, Any]], key: str) -> Optional[float]:
    values = [run[key] for run in runs if run[key] is not None]
    return statistics.median(values) if values else None


def mask_cases(llm: Any, args: argparse.Namespace, jump_forward: Any) -> dict[str, Any]:
    b, n = args.batch_size, args.output_len
    prompts = [_chat(llm, f"Write a long story about {TOPICS[i % len(TOPICS)]}.") for i in range(b)]
    scheduler = llm.engine.scheduler
    scheduler.speculator = None  # masked decoding alone
    answer = {"json": ANSWER_SCHEMA}
    modes = {
        "unconstrained": lambda: run_batch(llm, prompts, [_params(None, n, True)] * b, b),
        "all constrained": lambda: run_batch(llm, prompts, [_params(answer, n)] * b, b),
        "one constrained": lambda: run_batch(llm, prompts, [_params(answer, n)] + [_params(None, n, True)] * (b - 1),
                                             b),
    }
    results = _alternate(args.rounds, modes)
    scheduler.speculator = jump_forward
    step = {name: _median(runs, "step_s") for name, runs in results.items()}
    base = step["unconstrained"]
    return {"batch_size": b, "step_ms": {k: v * 1e3 if v else None for k, v in step.items()},
            "all_constrained_ratio": step["all constrained"] / base if base and step["all constrained"] else None,
            "one_constrained_ratio": step["one constrained"] / base if base and step["one constrained"] else None,
            "full_steps": {k: [r["num_full_steps"] for r in runs] for k, runs in results.items()}}


def jump_forward_cases(llm: Any, args: argparse.Namespace, jump_forward: Any) -> list[dict[str, Any]]:
    scheduler = llm.engine.scheduler
    prompts = [_chat(llm, f"Extract the person as JSON with keys {', '.join(EXTRACT_KEYS)}: {p}") for p in PEOPLE]
    schema = {"json": EXTRACT_SCHEMA}
    out = []
    for batch in sorted({1, args.batch_size}):
        def run(on: bool, batch: int = batch) -> dict[str, Any]:
            scheduler.speculator = jump_forward if on else None
            runs = [run_batch(llm, prompts[i:i + batch], [_params(schema, 128)] * len(prompts[i:i + batch]), batch)
                    for i in range(0, len(prompts), batch)]
            seconds = sum(sum(len(t) - 1 for t in r["outputs"]) / r["tokens_per_s"] for r in runs if r["tokens_per_s"])
            total = sum(len(t) - 1 for r in runs for t in r["outputs"])
            return {"tokens_per_s": total / seconds if seconds else 0.0, "outputs": [t for r in runs for t in r["outputs"]]}

        results = _alternate(args.rounds, {"masked": lambda: run(False), "jump-forward": lambda: run(True)})
        masked, jumped = _median(results["masked"], "tokens_per_s"), _median(results["jump-forward"], "tokens_per_s")
        same = all(a["outputs"] == b["outputs"] for a, b in zip(results["masked"], results["jump-forward"]))
        out.append({"batch_size": batch, "masked_tokens_per_s": masked, "jump_forward_tokens_per_s": jumped,
                    "speedup": jumped / masked if masked else None, "same_tokens": same})
    scheduler.speculator = jump_forward
    return out


def compile_case(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    from cluster.bench.schemas import structured_dataset
    from cluster.shared.structured import StructuredOutputsParams

    backend = llm.engine.structured
    seed = time.time_ns() % 1_000_000  # a new run never finds last run's schemas cached
    specs = [StructuredOutputsParams(**so) for _, so, _ in structured_dataset("json-unique", args.num_schemas, seed)]
    cold, cached = [], []
    for spec in specs:
        started = time.perf_counter()
        backend.compile(spec)
        cold.append((time.perf_counter() - started) * 1e3)
    for spec in specs:
        started = time.perf_counter()
        backend.compile(spec)
        cached.append((time.perf_counter() - started) * 1e3)
    return {"num_schemas": len(specs), "cold_ms_median": statistics.median(cold), "cold_ms_max": max(cold),
            "cached_ms_median": statistics.median(cached), "cached_ms_max": max(cached)}


def run_structured(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    from workers.llm import LLM

    llm = LLM(**{**engine_args, "max_num_seqs": max(engine_args.get("max_num_seqs") or 0, args.batch_size)})
    if llm.engine.structured is None:
        raise SystemExit("bench structured: this engine has no grammar backend (install xgrammar)")
    jump_forward = llm.engine.scheduler.speculator
    logger.info("warming up")
    run_batch(llm, [_chat(llm, "Hi")], [_params({"json": EXTRACT_SCHEMA}, 8)], 1)
    report = {"model": str(llm.model_dir), "rounds": args.rounds, "compile": compile_case(llm, args)}
    logger.info("mask cases (batch %d)", args.batch_size)
    report["mask"] = mask_cases(llm, args, jump_forward)
    logger.info("jump-forward cases")
    report["jump_forward"] = jump_forward_cases(llm, args, jump_forward)
    for line in format_report(report):
        print(line)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    logger.info("wrote %s", path)
    llm.shutdown()
    return 0


def _fmt(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_report(report: dict[str, Any]) -> list[str]:
    mask = report["mask"]
    rows = [["decode step, all unconstrained (ms)", _fmt(mask["step_ms"]["unconstrained"])],
            ["decode step, all constrained (ms)", _fmt(mask["step_ms"]["all constrained"])],
            ["  ratio (bar <= 1.05)", _fmt(mask["all_constrained_ratio"], 3)],
            ["decode step, 1 of B constrained (ms)", _fmt(mask["step_ms"]["one constrained"])],
            ["  ratio (bar <= 1.02)", _fmt(mask["one_constrained_ratio"], 3)]]
    for case in report["jump_forward"]:
        b = case["batch_size"]
        rows += [[f"batch {b}: masked decode (tok/s)", _fmt(case["masked_tokens_per_s"], 1)],
                 [f"batch {b}: jump-forward (tok/s)", _fmt(case["jump_forward_tokens_per_s"], 1)],
                 [f"  speedup (bar >= 1.3), same tokens: {case['same_tokens']}", _fmt(case["speedup"], 2)]]
    comp = report["compile"]
    rows += [[f"compile, cold, {comp['num_schemas']} distinct schemas (ms, median / max)",
              f"{comp['cold_ms_median']:.1f} / {comp['cold_ms_max']:.1f}"],
             ["compile, cached (ms, median / max)", f"{comp['cached_ms_median']:.3f} / {comp['cached_ms_max']:.3f}"]]
    header = (f"structured outputs, batch B = {mask['batch_size']}, {report['rounds']} rounds", "")
    return format_table([header, *[tuple(row) for row in rows]])
