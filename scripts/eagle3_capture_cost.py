"""What taking EAGLE-3's features costs the target (issue 36): decode steps of
the default model with the native decoder's one-call step (no capture) against
its per-layer loop with the three layers' inputs captured (``AuxHiddenCapture``,
as while an EAGLE-3 draft is the runner's), interleaved rounds in one process,
no draft run (the draft's own work is EAGLE-1's).

    .venv/bin/python scripts/eagle3_capture_cost.py [--batch 1] [--tokens 64] [--rounds 5]

Prints ms per step (generate time / tokens per sequence) per round and the minimum.
"""

from __future__ import annotations

import argparse
import time

from cluster.shared.types import SamplingParams
from workers.llm import LLM
from workers.spec_eagle3 import AuxHiddenCapture


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    llm = LLM(max_num_seqs=max(8, args.batch))
    model = llm.runner.model
    num_layers = len(model.model.layers)
    capture = AuxHiddenCapture(model, (2, num_layers // 2, num_layers - 3))
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    prompts = [[1, 504 + i, 3456, 28, 253, 1180, 314, 260, 2123, 30] for i in range(args.batch)]
    times: dict[str, list[float]] = {"one-call": [], "capture": []}
    for _ in range(args.rounds):
        for mode in times:
            capture.active = (lambda: mode == "capture")
            started = time.perf_counter()
            llm.generate(prompts, params)
            times[mode].append((time.perf_counter() - started) / args.tokens * 1000)
    for mode, values in times.items():
        print(f"batch {args.batch} {mode:9} ms/step per round {[round(v, 1) for v in values]} "
              f"min {min(values):.1f}")


if __name__ == "__main__":
    main()
