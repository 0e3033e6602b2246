"""``prefixserve bench offline``: our engine against Hugging Face ``generate``.

Both sides get the same seeded workload (random token prompts and output
lengths, EOS ignored so every request generates exactly its length) in one
run on the same weights. Hugging Face runs static padded batches (left
padding; a batch runs until its longest output); our engine runs one
continuous batch. Throughput counts only the tokens each request asked for.

Also measured: time to first token of a prompt whose ``--prefix-len``-token
prefix is in the prefix cache, against the same prompt cold.

Prints a table and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.client.table import format_table, percentile
from cluster.shared.sizes import cdiv

logger = logging.getLogger(__name__)


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class RunResult:
    name: str
    seconds: float
    output_tokens: int
    ttft: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def summary(self) -> dict[str, Any]:
        ttft = sorted(self.ttft)
        return {
            "name": self.name,
            "seconds": round(self.seconds, 3),
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": round(self.tokens_per_s, 2),
            "ttft_mean_s": round(statistics.fmean(ttft), 4) if ttft else None,
            "ttft_p50_s": round(percentile(ttft, 50), 4) if ttft else None,
            "ttft_p99_s": round(percentile(ttft, 99), 4) if ttft else None,
        }


def add_offline_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-input-len", type=int, default=32)
    parser.add_argument("--max-input-len", type=int, default=512)
    parser.add_argument("--min-output-len", type=int, default=16)
    parser.add_argument("--max-output-len", type=int, default=256)
    parser.add_argument("--workload-seed", type=int, default=0, help="seed of the random workload")
    parser.add_argument("--hf-batch-size", type=int, default=8, help="static batch size of the HF baseline")
    parser.add_argument("--skip-hf", action="store_true", help="measure only our engine")
    parser.add_argument("--prefix-len", type=int, default=512, help="cached prefix length for the TTFT test (0 skips)")
    parser.add_argument("--json", default="bench-results/offline.json", help="where to write the results")


def make_workload(args: argparse.Namespace, vocab_size: int, skip_ids: set[int]) -> Workload:
    rng = random.Random(args.workload_seed)
    usable = [t for t in range(min(vocab_size, 32000)) if t not in skip_ids]
    prompts, outs = [], []
    for _ in range(args.num_prompts):
        n = rng.randint(args.min_input_len, args.max_input_len)
        prompts.append([rng.choice(usable) for _ in range(n)])
        outs.append(rng.randint(args.min_output_len, args.max_output_len))
    return Workload(prompts, outs)


def run_engine(llm: Any, work: Workload) -> RunResult:
    from tqdm import tqdm

    from cluster.shared.types import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work.output_lens]
    requests = [llm.make_request(p, sp) for p, sp in zip(work.prompts, params)]
    start = time.perf_counter()
    for req in requests:
        llm.engine.add_request(req)
    first: dict[str, float] = {}
    produced = 0
    with tqdm(total=len(requests), desc="engine", unit="req") as bar:
        for out in llm.stream_until_done():
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start
            produced += len(out.new_token_ids)
            if out.finished:
                bar.update(1)
    seconds = time.perf_counter() - start
    assert produced == work.num_output_tokens, (produced, work.num_output_tokens)
    return RunResult("prefixserve", seconds, produced, list(first.values()))


def run_hf(model_dir: Path, work: Workload, batch_size: int, pad_id: int) -> RunResult:
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: run every batch to its length

    class FirstCall(LogitsProcessor):
        def __init__(self) -> None:
            self.at: float | None = None

        def __call__(self, input_ids, scores):  # noqa: D102
            if self.at is None:
                self.at = time.perf_counter()
            return scores

    ttft, produced = [], 0
    start = time.perf_counter()
    order = list(range(len(work.prompts)))
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        width = max(len(work.prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):  # left padding
            ids[row, width - len(work.prompts[i]) :] = torch.tensor(work.prompts[i])
            mask[row, width - len(work.prompts[i]) :] = 1
        new = max(work.output_lens[i] for i in idx)
        probe = FirstCall()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=new,
                do_sample=False, pad_token_id=pad_id, logits_processor=LogitsProcessorList([probe]),
            )
        assert out.shape[1] == width + new
        ttft.extend([probe.at - start] * len(idx))
        produced += sum(work.output_lens[i] for i in idx)
        logger.info("hf: batch %d/%d done (%.0fs)", b // batch_size + 1, cdiv(len(order), batch_size),
                    time.perf_counter() - start)
    return RunResult(f"hf-generate(batch={batch_size})", time.perf_counter() - start, produced, ttft)


def prefix_ttft(llm: Any, prefix_len: int, vocab_ids: list[int], seed: int) -> dict[str, float]:
    """TTFT of prefix+suffix with the prefix cached versus cold (medians of 3)."""
    from cluster.shared.types import SamplingParams

    rng = random.Random(seed + 1)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def ttft(prompt: list[int]) -> float:
        t0 = time.perf_counter()
        llm.generate([prompt], one)
        return time.perf_counter() - t0

    cold, warm, cached_tokens = [], [], []
    for _ in range(3):
        prefix = [rng.choice(vocab_ids) for _ in range(prefix_len)]
        cold.append(ttft(prefix + [rng.choice(vocab_ids) for _ in range(16)]))
        prompt = prefix + [rng.choice(vocab_ids) for _ in range(16)]
        t0 = time.perf_counter()
        out = llm.generate([prompt], one)[0]
        warm.append(time.perf_counter() - t0)
        cached_tokens.append(out.num_cached_tokens)
    return {
        "prefix_len": prefix_len,
        "ttft_cold_s": round(statistics.median(cold), 4),
        "ttft_cached_s": round(statistics.median(warm), 4),
        "num_cached_tokens": min(cached_tokens),
        "speedup": round(statistics.median(cold) / statistics.median(warm), 2),
    }


def run_offline(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    from cluster.shared.types import SamplingParams
    from workers.builder import freeze_heap
    from workers.llm import LLM

    llm = LLM(**engine_args)
    freeze_heap()  # one engine for this process's life
    vocab = llm.engine.vocab_size
    special = set(llm.engine.scheduler.eos_token_ids) | {0, 1, 2}
    work = make_workload(args, vocab, special)
    logger.info("workload: %d prompts, %d prompt tokens, %d output tokens", len(work.prompts),
                sum(map(len, work.prompts)), work.num_output_tokens)
    warm_start = time.perf_counter()
    llm.generate([work.prompts[0][:32]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    warmup_s = time.perf_counter() - warm_start
    compiled_before = llm.runner.num_compilations if hasattr(llm.runner, "num_compilations") else 0
    results = [run_engine(llm, work)]
    compiled_after = llm.runner.num_compilations if hasattr(llm.runner, "num_compilations") else 0
    if not args.skip_hf:
        results.append(run_hf(llm.model_dir, work, args.hf_batch_size, pad_id=min(special)))
    report: dict[str, Any] = {
        "workload": {k: getattr(args, k) for k in ("num_prompts", "min_input_len", "max_input_len",
                                                   "min_output_len", "max_output_len", "workload_seed")},
        "engine_args": {k: v for k, v in llm.config.flat().items() if isinstance(v, (int, float, str, bool, type(None)))},
        "runs": [r.summary() for r in results],
        # torch.compile (enforce_eager False): graphs built in the warm-up and during the timed run.
        "warmup_seconds": round(warmup_s, 2),
        "compilations": {"warmup": compiled_before, "timed_run": compiled_after - compiled_before},
    }
    if len(results) == 2:
        report["throughput_ratio"] = round(results[0].tokens_per_s / results[1].tokens_per_s, 2)
    if args.prefix_len:
        usable = [t for t in range(min(vocab, 32000)) if t not in special]
        report["prefix_cache"] = prefix_ttft(llm, args.prefix_len, usable, args.workload_seed)
    _print_table(report)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    logger.info("wrote %s", path)
    return 0


def _print_table(report: dict[str, Any]) -> None:
    rows = [("run", "seconds", "out tok/s", "TTFT mean", "TTFT p50", "TTFT p99")]
    for r in report["runs"]:
        rows.append((r["name"], f"{r['seconds']:.1f}", f"{r['output_tokens_per_s']:.1f}",
                     f"{r['ttft_mean_s']:.3f}", f"{r['ttft_p50_s']:.3f}", f"{r['ttft_p99_s']:.3f}"))
    lines = format_table(rows)
    if "throughput_ratio" in report:
        lines.append(f"throughput ratio (prefixserve / hf): {report['throughput_ratio']:.2f}x")
    comp = report.get("compilations", {})
    lines.append(f"warm-up {report.get('warmup_seconds', 0):.1f} s; torch.compile graphs: {comp.get('warmup', 0)} "
                 f"in the warm-up, {comp.get('timed_run', 0)} during the timed run")
    if "prefix_cache" in report:
        pc = report["prefix_cache"]
        lines.append(
            f"TTFT with {pc['prefix_len']}-token prefix cached: {pc['ttft_cached_s']:.3f}s "
            f"vs cold {pc['ttft_cold_s']:.3f}s ({pc['speedup']:.1f}x, {pc['num_cached_tokens']} tokens cached)"
        )
    print("\n".join(lines))  # the table is the program's output, not a log
