"""The engine alone on a benchmark's requests: the baseline ``bench serve
--engine-baseline`` sets the cluster's figures against.

Run in a child process (``measure``), so the benchmark's own process stays
light and the engine's threads and memory are gone before the cluster runs:

- ``step_ms``: the median decode step at batch 1 (``engine.step()``:
  scheduling, forward, sampling, detokenization), over the first request's
  output tokens, and at ``max_num_seqs`` 1 over every request's of the
  throughput run too (the cluster's ITL is a median over all its requests':
  one request's two seconds would be a single draw of a machine whose speed
  drifts by 10-40% from one minute to the next);
- ``prefill_ms``: the median first step (the whole prompt, prefilled in one
  step when it fits the token budget, as a replica does) of the first
  ``PREFILL_SAMPLES`` prompts, each run alone, and at ``max_num_seqs`` 1 of
  every prompt of the throughput run too;
- ``output_throughput``: every request run through one engine with
  ``max_num_seqs`` = the benchmark's ``--max-concurrency`` (as many in flight
  as the cluster gets), output tokens over the wall time.

Every prompt gets a fresh salt, so nothing is served from the prefix cache
that the cluster would have to compute.
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

logger = logging.getLogger(__name__)

PREFILL_SAMPLES = 5


def measure(engine_args: dict[str, Any], prompts: Sequence[Sequence[int]], output_lens: Sequence[int],
            max_concurrency: Optional[int], timeout_s: float = 1800.0) -> dict[str, float]:
    """Runs the baseline in a child process; returns its figures (module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.json"
        out = Path(tmp) / "out.json"
        spec.write_text(json.dumps({"engine_args": engine_args, "prompts": [list(p) for p in prompts],
                                    "output_lens": list(output_lens), "max_concurrency": max_concurrency}))
        logger.info("engine baseline: %d requests on the engine alone, in a child process", len(prompts))
        subprocess.run([sys.executable, "-m", "cluster.bench.engine_baseline", str(spec), str(out)], check=True,
                       timeout=timeout_s)
        return json.loads(out.read_text())


def run(engine_args: dict[str, Any], prompts: Sequence[Sequence[int]], output_lens: Sequence[int],
        max_concurrency: Optional[int]) -> dict[str, float]:
    """The figures, measured in this process."""
    from cluster.shared.config import EngineConfig
    from cluster.shared.types import GenerationRequest, SamplingParams
    from workers.builder import build_engine

    args = dict(engine_args)
    if max_concurrency:
        budget = EngineConfig.from_kwargs(**args).scheduler.max_num_batched_tokens
        args.update(max_num_seqs=max_concurrency, max_num_batched_tokens=max(budget, max_concurrency))
    engine = build_engine(EngineConfig.from_kwargs(**args)).engine

    def request(i: int, salt: str, max_tokens: Optional[int] = None) -> GenerationRequest:
        params = SamplingParams(max_tokens=max_tokens or int(output_lens[i]), ignore_eos=True, temperature=0.0)
        return GenerationRequest(f"{salt}-{i}", list(prompts[i]), params, cache_salt=salt)

    engine.add_request(request(0, "warm-up"))  # first-call costs (allocations, kernel builds)
    while engine.has_unfinished_requests():
        engine.step()
    prefills, decode = [], []
    for i in range(min(PREFILL_SAMPLES, len(prompts))):
        # The first request decodes its whole output (the batch-1 step); the others
        # only prefill, each its own prompt, so the prefill is a median as the TTFT is.
        engine.add_request(request(i, f"single-{i}", max_tokens=1 if i else None))
        steps = []
        while engine.has_unfinished_requests():
            began = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - began)
        prefills.append(steps[0])
        decode.extend(steps[1:])
    began = time.perf_counter()
    for i in range(len(prompts)):
        engine.add_request(request(i, "all"))
    seen: set[str] = set()
    while engine.has_unfinished_requests():
        step_began = time.perf_counter()
        outputs = engine.step()
        if engine.scheduler.max_num_seqs == 1 and len(outputs) == 1:  # batch 1: every request's steps count too
            first = outputs[0].request_id not in seen
            seen.add(outputs[0].request_id)
            (prefills if first else decode).append(time.perf_counter() - step_began)
    wall = time.perf_counter() - began
    return {
        "step_ms": 1000 * statistics.median(decode) if decode else float("nan"),
        "prefill_ms": 1000 * statistics.median(prefills),
        "prefill_samples": len(prefills),
        "decode_samples": len(decode),
        "prompt_tokens": len(prompts[0]),
        "output_throughput": sum(int(n) for n in output_lens) / wall,
        "max_num_seqs": engine.scheduler.max_num_seqs,
    }


def main(argv: Sequence[str]) -> int:
    logging.basicConfig(level=logging.WARNING)
    spec = json.loads(Path(argv[0]).read_text())
    figures = run(spec["engine_args"], spec["prompts"], spec["output_lens"], spec["max_concurrency"])
    Path(argv[1]).write_text(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
