"""Held-out first-guess accuracy of an EAGLE-3 draft against an EAGLE-1 one
fitted on the same answers of the same model (issue 36): one generation of
greedy answers, one prefill per sequence that keeps both the final hidden
states (EAGLE-1's rows) and the three layers' inputs (EAGLE-3's), the same
tenth held out, each fitted with its default schedule (400 optimizer steps).

    .venv/bin/python scripts/eagle3_accuracy.py [--num-prompts 48] [--gen-len 64] [--steps 400] [--json F]

Prints the untrained and trained accuracy of each and the seconds each fit took.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from workers.eagle3_train import fit_eagle3
from workers.eagle_train import fit_eagle
from workers.llm import LLM
from workers.medusa_train import final_hidden_states, greedy_answers, head_and_embedding
from workers.model.eagle3 import default_aux_layer_ids
from workers.model.loader import read_arch
from workers.spec_eagle3 import AuxHiddenCapture


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="target (default: the packaged default model)")
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--vocab", type=int, default=8192, help="EAGLE-1 shortlist and EAGLE-3 draft vocabulary")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    llm = LLM(args.model, max_num_seqs=32) if args.model else LLM(max_num_seqs=32)
    started = time.perf_counter()
    prompts, outs = greedy_answers(llm, args.num_prompts, args.prompt_len, args.gen_len, 0)
    model = llm.runner.model
    ids = default_aux_layer_ids(len(model.model.layers))
    capture = AuxHiddenCapture(model, ids)
    rows1, rows3 = [], []
    for prompt, out in zip(prompts, outs):
        if len(out.token_ids) >= 4:
            seq = prompt + out.token_ids
            rows1.append((final_hidden_states(llm, seq), seq, len(prompt) - 1))
            rows3.append((capture.take().float().clone(), seq, len(prompt) - 1))
    capture.remove()
    data_s = time.perf_counter() - started
    arch = read_arch(llm.model_dir)
    head, embedding = head_and_embedding(llm.model_dir)
    norm = model.model.norm.weight.detach().float().cpu()
    report = {"model": str(llm.model_dir), "num_sequences": len(rows1), "data_seconds": round(data_s, 1),
              "torch_threads": torch.get_num_threads()}
    print(f"{len(rows1)} sequences in {data_s:.0f} s", flush=True)
    print(f"{'draft':8} {'untrained':>10} {'trained':>8} {'steps':>6} {'fit s':>7}", flush=True)
    for name in ("eagle", "eagle3"):  # each row printed as soon as its fit ends
        if name == "eagle":
            _, r = fit_eagle(rows1, arch, head, embedding, shortlist=args.vocab, min_steps=args.steps)
        else:
            _, r = fit_eagle3(rows3, arch, ids, head, embedding, norm, draft_vocab_size=args.vocab,
                              min_steps=args.steps)
        report[name] = r
        print(f"{name:8} {r['held_out_top1_accuracy_untrained'][0]:>10.3f} {r['held_out_top1_accuracy'][0]:>8.3f} "
              f"{r['optimizer_steps']:>6} {r['train_seconds']:>7.0f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
