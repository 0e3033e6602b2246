"""``prefixserve train-heads``: fit Medusa heads (or, ``--method eagle``, an
EAGLE-1 draft layer; ``--method eagle3``, an EAGLE-3 one) for a model on its own greedy answers to prompts
made from text shipped with Python (``workers/medusa_train.py``, ``workers/eagle_train.py``, ``eagle3_train.py``).

    prefixserve train-heads --output /tmp/smol-medusa              # a few minutes on 2 CPU cores
    prefixserve generate --chat "Explain closures" \\
        --speculative-config '{"method": "medusa", "model": "/tmp/smol-medusa"}'
    prefixserve train-heads --method eagle --output /tmp/smol-eagle
    prefixserve train-heads --method eagle3 --output /tmp/smol-eagle3

Engine flags (``--model``, ...) choose the model; the heads are tied to it
(its fingerprint is stored in their config.json).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def add_train_heads_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", required=True, help="folder to write the heads to (created)")
    parser.add_argument("--method", choices=("medusa", "eagle", "eagle3"), default="medusa",
                        help="medusa: Medusa heads; eagle / eagle3: an EAGLE-1 / EAGLE-3 draft layer in vLLM's "
                             "layout")
    parser.add_argument("--num-heads", type=int, default=4, help="heads: guesses per step (default 4)")
    parser.add_argument("--num-prompts", type=int, default=512, help="prompts answered for training")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens of each raw-text prompt")
    parser.add_argument("--gen-len", type=int, default=128, help="tokens of each greedy answer")
    parser.add_argument("--epochs", type=int, default=None,
                        help="passes over the data (medusa 2; eagle, eagle3: as many as make 400 optimizer steps)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate, one cycle (medusa 2e-3, "
                        "eagle, eagle3 1e-3)")
    parser.add_argument("--train-seed", type=int, default=0, help="prompt order and initialization")
    parser.add_argument("--shortlist", type=int, default=8192,
                        help="score the heads on the N tokens the answers use most (0: every token; "
                             "eagle3: its draft vocabulary)")
    parser.add_argument("--token-conditioned", action=argparse.BooleanOptionalAction, default=True,
                        help="heads also read the token just sampled (medusa_token_conditioned; "
                             "--no-token-conditioned: Medusa's plain heads)")


def run_train_heads(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    from workers.llm import LLM
    from workers.medusa_train import train_heads

    if not 1 <= args.num_heads <= 16:
        raise ValueError(f"--num-heads must be in 1..16, got {args.num_heads}")
    out = Path(args.output)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty: pass a new --output folder")
    engine_args = {"max_num_seqs": 32, **engine_args}
    if args.method == "eagle3":
        from workers.eagle3_train import train_eagle3

        with LLM(**engine_args) as llm:
            summary = train_eagle3(llm, out, num_prompts=args.num_prompts, prompt_len=args.prompt_len,
                                   gen_len=args.gen_len, epochs=args.epochs, lr=args.lr or 1e-3,
                                   seed=args.train_seed, draft_vocab_size=args.shortlist or 1 << 30)
        print(json.dumps(summary, indent=2))  # the command's output
        return 0
    if args.method == "eagle":
        from workers.eagle_train import train_eagle

        with LLM(**engine_args) as llm:
            summary = train_eagle(llm, out, num_prompts=args.num_prompts, prompt_len=args.prompt_len,
                                  gen_len=args.gen_len, epochs=args.epochs, lr=args.lr or 1e-3,
                                  seed=args.train_seed, shortlist=args.shortlist)
        print(json.dumps(summary, indent=2))  # the command's output
        return 0
    with LLM(**engine_args) as llm:
        summary = train_heads(llm, out, num_heads=args.num_heads, num_prompts=args.num_prompts,
                              prompt_len=args.prompt_len, gen_len=args.gen_len, epochs=args.epochs or 2,
                              lr=args.lr or 2e-3,
                              seed=args.train_seed, shortlist=args.shortlist,
                              token_conditioned=args.token_conditioned)
    print(json.dumps(summary, indent=2))  # the command's output
    return 0
