"""What EAGLE's runner-side work costs per step when adaptive speculation
proposes nothing (issue 36): the lazy catch-up (``workers/spec_eagle.py``)
against the eager one of commit d78938b~1 (every kept row through the whole
draft layer, every step), interleaved rounds on one loaded model.

    .venv/bin/python scripts/eagle_catchup_cost.py DRAFT_DIR [--rounds 3] [--tokens 48]

Prints, per batch size and proposer, the proposer's own time per step and its
share of the generate time (the speculator asks for no proposals, as adaptive
speculation does for a draft whose guesses do not pay).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import tempfile
import time
from pathlib import Path

from cluster.shared.types import SamplingParams
from workers.llm import LLM

EAGER = "d78938b~1"  # the last commit with the eager catch-up


def eager_proposer_class():
    source = subprocess.run(["git", "show", f"{EAGER}:workers/spec_eagle.py"], capture_output=True, text=True,
                            check=True, cwd=Path(__file__).resolve().parents[1]).stdout
    path = Path(tempfile.mkdtemp()) / "eager_spec_eagle.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("eager_spec_eagle", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.EagleProposer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("draft")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    llm = LLM(speculative_config={"method": "eagle", "model": args.draft}, max_num_seqs=8)
    runner = llm.engine.runner
    lazy = runner.medusa
    eager = eager_proposer_class()(lazy.draft, lazy.embed, runner.model.lm_head, runner.num_kv_blocks,
                                   runner.block_size)
    llm.engine.scheduler.speculator.runner_proposals_wanted = lambda rid: 0
    prompts = [llm.encode("Summarize the history of the printing press in Europe, in detail. " * (3 + i))
               for i in range(8)]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    results: dict[tuple[str, int], list[tuple[float, float, int]]] = {}
    for round_index in range(args.rounds):
        names = ["eager", "lazy", "none"]
        for name in names if round_index % 2 == 0 else names[::-1]:
            for batch in (1, 8):
                proposer = {"eager": eager, "lazy": lazy, "none": None}[name]
                spent = [0.0, 0]
                if proposer is not None:
                    inner = proposer.step_proposals

                    def timed(*a, _inner=inner, **k):
                        start = time.perf_counter()
                        out = _inner(*a, **k)
                        spent[0] += time.perf_counter() - start
                        spent[1] += 1
                        return out

                    proposer.step_proposals = timed
                runner.medusa = proposer
                start = time.perf_counter()
                llm.generate(prompts[:batch], params)
                total = time.perf_counter() - start
                if proposer is not None:
                    del proposer.step_proposals
                results.setdefault((name, batch), []).append((total, spent[0], spent[1]))
    runner.medusa = lazy
    print("proposer  batch  ms per step  share of generate time  median generate s (none: no proposer)")
    for (name, batch), rows in sorted(results.items()):
        calls = sum(r[2] for r in rows)
        per_step = 1e3 * sum(r[1] for r in rows) / calls if calls else 0.0
        share = sum(r[1] for r in rows) / sum(r[0] for r in rows)
        median = sorted(r[0] for r in rows)[len(rows) // 2]
        print(f"{name:8}  {batch:5}  {per_step:11.3f}  {100 * share:21.1f}%  {median:.3f}")


if __name__ == "__main__":
    main()
