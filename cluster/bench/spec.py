"""``prefixserve bench spec``: decode speed with speculative decoding against
without it, on the same loaded model, in one run.

Workloads (per batch size B, B distinct prompts; for ``grounded`` and
``chat`` below batch 8, 8 // B groups of B prompts, decoded one group after
another and counted together, so a batch-1 figure is not one prompt's):

* ``grounded``: repeat a given passage of English text (the language
  reference shipped with Python, ``cluster/shared/text_corpus.py``): the
  output quotes the prompt, what n-gram lookup is for;
* ``random``: random-token prompts, greedy (the default model soon repeats
  itself there, and lookup finds it);
* ``sampled``: random-token prompts sampled at temperature 1 (seeded per
  request), where proposals fail: speculation must then cost nothing;
* ``chat``: open-ended questions in the model's chat template, greedy (not
  taken from the text ``train-heads`` learns from).

Each case runs with speculation off, with the given ``--speculative-config``
(adaptive unless it says ``"adaptive": false``) and, with ``--fixed``, the same
config forced to always propose; with ``num_candidates`` > 1 (a tree) and
``--chain``, also as one chain (``num_candidates`` 1), so tree and chain are
measured in the same run. Prefill is untimed; decode tokens/s is the
tokens generated after every sequence's first token over the time they took.
Outputs with speculation (greedy, or seeded) are checked token for token
against the run without it. With ``--rounds`` N every case runs N times in turn and medians are
kept (odd rounds run the modes in reverse order), so a machine's drift hits
all modes alike.

Per mode it reports tokens per drafting step (accepted drafts + 1) and the
acceptance by draft position: of the drafts that reached position i, the share
whose tokens up to i were all accepted, counts pooled over the rounds.

Prints a table and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from pathlib import Path
from typing import Any, Optional

from cluster.client.table import format_table

logger = logging.getLogger(__name__)

DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4}
WORKLOADS = ("grounded", "random", "sampled", "chat")
CHAT_QUESTIONS = [
    "What are some good habits for staying healthy?", "Write a short poem about the ocean.",
    "How does a refrigerator keep food cold?", "Give me three ideas for a weekend trip.",
    "Why is the sky blue?", "Explain what a database index is.", "What should I cook for dinner tonight?",
    "Tell me a story about a brave little mouse.", "How do plants make their food?",
    "What is the difference between weather and climate?", "How can I learn to play the guitar?",
    "Describe your ideal city.", "What are the benefits of reading books?", "How do airplanes fly?",
    "Write a thank-you note to a teacher.", "What is machine learning?",
]


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32], help="decode batch sizes")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--input-len", type=int, default=192, help="prompt tokens (about)")
    parser.add_argument("--output-len", type=int, default=96, help="tokens generated per sequence")
    parser.add_argument("--fixed", action="store_true",
                        help="also run the config with adaptive off (always propose)")
    parser.add_argument("--chain", action="store_true",
                        help="with num_candidates > 1 (a tree): also run the config as one chain")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every case; medians are kept")
    parser.add_argument("--also", nargs="+", default=[], metavar="JSON",
                        help="more speculative configs measured side by side in the same run (e.g. medusa and "
                             "ngram beside an eagle --speculative-config), each mode named by its method")
    parser.add_argument("--json", default="bench-results/spec.json", help="where to write the results")


def grounded_prompts(llm: Any, n: int, length: int) -> list[list[int]]:
    """``n`` prompts asking to repeat a passage, each ending inside the passage's
    repetition (so the continuation is in the prompt)."""
    from cluster.shared.text_corpus import held_out_text

    paragraphs = [p for p in held_out_text().split("\n\n") if len(p) > 400]
    prompts = []
    for i in range(n):
        passage = llm.encode(paragraphs[i % len(paragraphs)], add_special_tokens=False)[: max(32, length - 48)]
        head = llm.encode("Repeat the following text exactly.\n\nText:\n")
        tail = llm.encode("\n\nThe same text, repeated:\n", add_special_tokens=False)
        prompts.append(head + passage + tail + passage[:8])
    return prompts


def chat_prompts(llm: Any, n: int) -> list[list[int]]:
    """``n`` open-ended questions, rendered with the model's chat template."""
    from cluster.shared.chat_template import ChatTemplate

    template = ChatTemplate.from_model_dir(llm.model_dir)
    return [llm.encode(template.render([{"role": "user", "content": CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]}]),
                       add_special_tokens=False) for i in range(n)]


def random_prompts(llm: Any, n: int, length: int, rng: random.Random) -> list[list[int]]:
    from cluster.bench.latency import make_prompts

    skip = set(llm.engine.scheduler.eos_token_ids) | {0, 1, 2}
    return make_prompts(n, length, llm.engine.vocab_size, skip, rng)


GROUPED = ("grounded", "chat")  # workloads whose prompts differ in kind: several groups below batch 8
SPEC_COUNTS = ("num_draft_tokens", "num_accepted_tokens", "num_drafts", "num_branch_trials", "num_branch_hits")
PER_POSITION = ("accepted_per_position", "proposed_per_position")  # counts per draft position (lists)


def decode_run(llm: Any, prompts: list[list[int]], output_len: int, sampled: bool = False,
               group_size: Optional[int] = None) -> dict[str, Any]:
    """``output_len`` tokens each, greedy (or ``sampled``: temperature 1, a seed
    per request), ``group_size`` prompts at a time (default: all at once):
    decode tokens/s after every first token, the outputs, and what
    speculation did meanwhile, over every group."""
    size = group_size or len(prompts)
    groups = [_decode_group(llm, prompts[i : i + size], output_len, sampled, first=i)
              for i in range(0, len(prompts), size)]
    seconds = sum(g["seconds"] for g in groups)
    steps = sum(g["steps"] for g in groups)
    result: dict[str, Any] = {
        "decode_tokens_per_s": sum(g["generated"] for g in groups) / seconds if seconds > 0 else 0.0,
        "seconds": seconds, "steps": steps,
        "schedule_ms_per_step": 1e3 * sum(g["scheduling"] for g in groups) / max(1, steps),
        "outputs": [out for g in groups for out in g["outputs"]],
    }
    if "spec" in groups[0]:
        total = {key: sum(g["spec"][key] for g in groups) for key in SPEC_COUNTS}
        drafted, accepted, drafts = total["num_draft_tokens"], total["num_accepted_tokens"], total["num_drafts"]
        trials, wins = total["num_branch_trials"], total["num_branch_hits"]
        result.update(branch_trials=trials, branch_win_rate=wins / trials if trials else 0.0)
        result.update(draft_tokens=drafted, accepted_tokens=accepted, drafts=drafts,
                      acceptance_rate=accepted / drafted if drafted else 0.0,
                      mean_acceptance_length=1 + accepted / drafts if drafts else 0.0)
        result.update({key: [sum(col) for col in zip(*(g["spec"][key] for g in groups))] for key in PER_POSITION})
    return result


def _decode_group(llm: Any, prompts: list[list[int]], output_len: int, sampled: bool, first: int
                  ) -> dict[str, Any]:
    """One batch of ``decode_run`` (seeds from ``first``, the group's first prompt): raw counts."""
    from cluster.shared.types import SamplingParams

    engine = llm.engine
    params = [SamplingParams(max_tokens=output_len, temperature=1.0 if sampled else 0.0,
                             seed=first + i if sampled else None, ignore_eos=True) for i in range(len(prompts))]
    requests = [llm.make_request(p, sp) for p, sp in zip(prompts, params)]
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for req in requests:
        engine.add_request(req)
    while any(not out for out in outputs.values()):  # prefill, untimed
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    speculator = engine.scheduler.speculator
    before = speculator.stats.as_dict() if speculator is not None else None
    before_tokens = sum(len(o) for o in outputs.values())
    steps0, scheduling0 = engine.num_steps, engine.schedule_seconds
    begin = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    group: dict[str, Any] = {
        "seconds": time.perf_counter() - begin, "generated": sum(len(o) for o in outputs.values()) - before_tokens,
        "steps": engine.num_steps - steps0, "scheduling": engine.schedule_seconds - scheduling0,
        "outputs": [outputs[r.request_id] for r in requests],
    }
    if speculator is not None and before is not None:
        after = speculator.stats.as_dict()
        group["spec"] = {key: after[key] - before[key] for key in SPEC_COUNTS}
        group["spec"].update({key: [a - b for a, b in zip(after[key], before[key])] for key in PER_POSITION})
    return group


def run_spec(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    from cluster.shared.config import SpeculativeConfig
    from workers.engine.spec_decode import Speculator
    from workers.llm import LLM

    spec = SpeculativeConfig.from_mapping(engine_args.pop("speculative_config", None) or DEFAULT_SPEC)
    max_batch = max(args.batch_sizes)
    base = {"max_num_seqs": max(8, max_batch), "max_num_batched_tokens": max(2048, max_batch * (args.input_len + 64)),
            **engine_args}
    load_start = time.perf_counter()
    llm = LLM(**base, speculative_config=spec.__dict__)  # builds the proposer (a draft model's runner too)
    load_s = time.perf_counter() - load_start
    proposer = llm.engine.scheduler.speculator.proposer
    tree = "-tree" if spec.num_candidates > 1 else ""
    main = ("adaptive" if spec.adaptive else "fixed") + tree
    extras = [SpeculativeConfig.from_mapping(text) for text in getattr(args, "also", [])]
    if extras:  # side by side: every mode named by its method
        main = _mode_name(spec)
    modes: dict[str, Optional[SpeculativeConfig]] = {"off": None, main: spec}
    # Per mode: its proposer and what the runner proposes with (Medusa heads, an EAGLE draft, or nothing).
    proposers = {main: (proposer, llm.runner.medusa)}
    for config in extras:
        modes[_mode_name(config)] = config
        proposers[_mode_name(config)] = _extra_proposer(llm, config)
    if args.fixed and spec.adaptive:
        fixed = SpeculativeConfig(**{**spec.__dict__, "adaptive": False})
        modes[_mode_name(fixed) if extras else "fixed" + tree] = fixed
    if getattr(args, "chain", False) and tree:
        for name, config in list(modes.items())[1:]:
            modes[name.replace("-tree", "-chain")] = SpeculativeConfig(**{**config.__dict__, "num_candidates": 1})
    rng = random.Random(0)
    decode_run(llm, random_prompts(llm, max_batch, 16, rng), 8)  # warm-up: kernels built, caches warm
    cases = [(w, b) for w in args.workloads for b in args.batch_sizes]
    makers = {"grounded": lambda n: grounded_prompts(llm, n, args.input_len), "chat": lambda n: chat_prompts(llm, n),
              "random": lambda n: random_prompts(llm, n, args.input_len, rng),
              "sampled": lambda n: random_prompts(llm, n, args.input_len, rng)}
    prompts = {(w, b): makers[w](b * (max(1, 8 // b) if w in GROUPED else 1)) for w, b in cases}
    runs: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for round_index in range(max(1, args.rounds)):
        for case in cases:
            # Odd rounds run the modes in reverse: a machine drifting during a case favours none.
            for mode, config in list(modes.items())[:: -1 if round_index % 2 else 1]:
                logger.info("round %d: %s batch %d, speculation %s", round_index + 1, case[0], case[1], mode)
                chosen, slot = proposers.get(mode, proposers[main])
                llm.runner.medusa = slot if config is not None else None
                llm.engine.scheduler.speculator = Speculator(config, chosen) if config is not None else None
                llm.engine.scheduler.kv_manager.reset_prefix_cache()  # every mode prefills alike
                runs.setdefault((*case, mode), []).append(
                    decode_run(llm, prompts[case], args.output_len, sampled=case[0] == "sampled", group_size=case[1]))
    llm.engine.scheduler.speculator = None
    report = {"model": str(llm.model_dir), "speculative_config": spec.__dict__,
              "also": [config.__dict__ for config in extras], "rounds": max(1, args.rounds),
              "load_seconds": round(load_s, 2), "output_len": args.output_len, "cases": []}
    for workload, batch in cases:
        row: dict[str, Any] = {"workload": workload, "batch_size": batch,
                               "groups": len(prompts[(workload, batch)]) // batch,
                               "prompt_tokens": statistics.mean(len(p) for p in prompts[(workload, batch)])}
        reference = runs[(workload, batch, "off")][0]["outputs"]
        for mode in modes:
            results = runs[(workload, batch, mode)]
            entry = {"decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in results),
                     "steps": statistics.median(r["steps"] for r in results),
                     "schedule_ms_per_step": statistics.median(r["schedule_ms_per_step"] for r in results),
                     "step_ms": statistics.median(1e3 * r["seconds"] / max(1, r["steps"]) for r in results),
                     # Each round's figure, in round order (odd rounds ran the modes in reverse): drift shows.
                     "decode_tokens_per_s_by_round": [round(r["decode_tokens_per_s"], 2) for r in results]}
            if mode != "off":
                entry["identical_to_off"] = all(r["outputs"] == reference for r in results)
                for key in ("acceptance_rate", "mean_acceptance_length", "draft_tokens", "drafts", "branch_trials",
                            "branch_win_rate"):
                    entry[key] = statistics.median(r[key] for r in results)
                entry.update(acceptance_by_position(results))
                entry.update(paired_and_pooled(runs[(workload, batch, "off")], results))
            row[mode] = entry
        report["cases"].append(row)
    print("\n".join(format_report(report, list(modes))))  # the table is the program's output
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    logger.info("wrote %s", path)
    llm.shutdown()
    return 0


def paired_and_pooled(off: list[dict[str, Any]], results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each round's tokens/s ratio to off's in the same round (the machine's
    drift between rounds cancels), and the counts pooled over every round
    (a median of rounds reads 1.00 tokens/step where most rounds drafted a
    handful of times)."""
    ratios = [r["decode_tokens_per_s"] / o["decode_tokens_per_s"]
              for r, o in zip(results, off) if o["decode_tokens_per_s"] > 0]
    drafted = sum(r["draft_tokens"] for r in results)
    drafts = sum(r["drafts"] for r in results)
    accepted = sum(r["accepted_tokens"] for r in results)
    steps = sum(r["steps"] for r in results)
    return {"ratio_by_round": [round(x, 4) for x in ratios],
            "ratio_per_round_median": statistics.median(ratios) if ratios else 0.0,
            "pooled_draft_tokens": drafted, "pooled_drafts": drafts,
            "pooled_acceptance_rate": accepted / drafted if drafted else 0.0,
            "pooled_tokens_per_drafting_step": 1 + accepted / drafts if drafts else 0.0,
            "pooled_tokens_per_step": sum(o["steps"] for o in off) / steps if steps else 0.0}


def acceptance_by_position(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per draft position i, over every round (counts pooled): of the drafts
    that proposed a token at i, the share whose tokens up to i were all
    accepted (vLLM's accepted-per-position / drafts when every draft is full
    length; adaptive drafts vary in length, so each position counts only the
    drafts that reached it)."""
    accepted = [sum(col) for col in zip(*(r["accepted_per_position"] for r in results))]
    proposed = [sum(col) for col in zip(*(r["proposed_per_position"] for r in results))]
    return {"accepted_per_position": accepted, "proposed_per_position": proposed,
            "acceptance_per_position": [a / p if p else None for a, p in zip(accepted, proposed)]}


def _mode_name(config: Any) -> str:
    return config.method + ("" if config.adaptive else "-fixed") + ("-tree" if config.num_candidates > 1 else "")


def _extra_proposer(llm: Any, config: Any) -> tuple[Any, Any]:
    """The proposer of another speculative config on the same model, and what
    the runner proposes with for it (loaded now; the runner's own is put back)."""
    from workers.engine.proposers import NgramProposer

    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max), None
    if config.method not in ("medusa", "eagle", "eagle3"):
        raise ValueError(f"--also takes ngram, medusa, eagle and eagle3 configs, got {config.method!r}")
    from workers.builder import attach_medusa_heads
    from workers.model.loader import read_arch
    from workers.spec_eagle import attach_eagle
    from workers.spec_eagle3 import attach_eagle3

    runner, kept = llm.runner, llm.runner.medusa
    attach = {"eagle": attach_eagle, "eagle3": attach_eagle3, "medusa": attach_medusa_heads}[config.method]
    proposer = attach(runner, config.model, read_arch(llm.model_dir))
    slot, runner.medusa = runner.medusa, kept
    return proposer, slot


def format_report(report: dict[str, Any], modes: list[str]) -> list[str]:
    header: tuple[str, ...] = ("workload", "batch", "off tok/s")
    for mode in modes[1:]:
        header += (f"{mode} tok/s", "ratio", "per round [range]", "accept", "tokens/step", "same tokens")
        if mode.endswith("-tree"):
            header += ("other branch won",)
    rows = [header]
    for case in report["cases"]:
        off = case["off"]["decode_tokens_per_s"]
        cells = [case["workload"], str(case["batch_size"]), f"{off:.1f}"]
        for mode in modes[1:]:
            fig = case[mode]
            by_round = fig.get("ratio_by_round") or []
            drafted = fig.get("pooled_draft_tokens", fig["draft_tokens"])
            cells += [f"{fig['decode_tokens_per_s']:.1f}", f"{fig['decode_tokens_per_s'] / off:.2f}x" if off else "-",
                      f"{fig['ratio_per_round_median']:.2f}x [{min(by_round):.2f}-{max(by_round):.2f}]"
                      if by_round else "-",
                      f"{fig.get('pooled_acceptance_rate', fig['acceptance_rate']):.0%}" if drafted else "-",
                      f"{fig.get('pooled_tokens_per_drafting_step', fig['mean_acceptance_length']):.2f}"
                      if drafted else "-",
                      "yes" if fig["identical_to_off"] else "NO"]
            if mode.endswith("-tree"):
                won = fig["branch_win_rate"]
                cells.append(f"{won:.0%} of {fig['branch_trials']:.0f}" if fig["branch_trials"] else "-")
        rows.append(tuple(cells))
    lines = format_table(rows)
    for case in report["cases"]:  # what proposing costs, apart from the machine's drift
        costs = ", ".join(f"{mode} {case[mode]['schedule_ms_per_step']:.2f}" for mode in modes)
        lines.append(f"{case['workload']} batch {case['batch_size']}: schedule() ms per step (proposals included): "
                     f"{costs}; off step {case['off']['step_ms']:.1f} ms")
    for case in report["cases"]:  # acceptance by draft position, of the drafts that reached it
        shares = [f"{mode} " + " ".join("-" if share is None else f"{share:.0%}"
                                       for share in case[mode].get("acceptance_per_position", []))
                  + f" (of {sum(case[mode].get('proposed_per_position', [])[:1])} drafts)" for mode in modes[1:]]
        lines.append(f"{case['workload']} batch {case['batch_size']}: acceptance by position: {'; '.join(shares)}")
    grouped = [f"{c['workload']} batch {c['batch_size']}: {c['groups']} groups"
               for c in report["cases"] if c.get("groups", 1) > 1]
    also = "".join(f", {json.dumps(config)}" for config in report.get("also", []))
    lines.append(f"speculative_config {json.dumps(report['speculative_config'])}{also}; "
                 f"{report['output_len']} tokens per "
                 f"sequence; {'; '.join(grouped) + ' one after another; ' if grouped else ''}"
                 f"median of {report['rounds']} round(s); ratio: of the medians; per round: the median "
                 "[range] of each round's ratio to off in that round; accept and tokens/step (accepted drafts + 1 "
                 "per drafting step): rounds pooled; acceptance by position: of the drafts with a token at position i, the share "
                 "whose tokens 1..i were all accepted (rounds pooled); other branch won: where a tree's first "
                 "candidate was rejected at a node with others, how often another candidate's token was taken")
    return lines
