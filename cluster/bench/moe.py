"""``prefixserve bench moe``: mixture-of-experts decode with routed experts
against a dense loop over every expert, on the same weights, in one run.

The model is a random-init Mixtral-style checkpoint (``--hidden-size``,
``--num-layers``, ``--num-experts``, ``--top-k``, ``--intermediate-size``;
the defaults make ~200M parameters), written once into the cache folder.
Two engines load it: ours (``workers/model/moe.py``: each chosen expert runs
once, on the tokens routed to it) and the baseline, whose MoE layers run
every expert on every token and weigh the outputs by the same routing (zero
for the experts a token did not choose), the naive dense loop (in the same
C call as ours where the layer is native: ``moe_f32.c``'s ``dense``). Their decode
steps alternate, ``--interleave-steps`` of one then of the other, both
batches alive, so the machine's drift slows both alike; the greedy tokens of
the two must be the same.

Prints a table (step times, tokens/s, the ratio), writes JSON (``--json``).
``--write-gguf PATH`` writes the same model as a Mixtral GGUF instead
(``moe_gguf.py``), for ``bench latency --compare llama.cpp`` on one file.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
from pathlib import Path
from typing import Any

from cluster.client.table import format_table

logger = logging.getLogger(__name__)


def add_moe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2, help="experts per token")
    parser.add_argument("--intermediate-size", type=int, default=1536, help="of one expert")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32, help="decode steps timed per batch size")
    parser.add_argument("--interleave-steps", type=int, default=4)
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--write-gguf", default=None, metavar="PATH",
                        help="write the model as a Mixtral GGUF (Q5_0 experts, Q8_0 the rest) to PATH and exit, "
                             "for bench latency --model PATH --compare llama.cpp")


def mixtral_dir(args: argparse.Namespace) -> Path:
    """The random-init checkpoint of ``args``' shape (written once, then reused)."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    from cluster.shared.cache import cache_root
    from workers.model.loader import resolve_model

    shape = (args.hidden_size, args.num_layers, args.num_experts, args.top_k, args.intermediate_size)
    folder = cache_root() / "bench-moe" / "mixtral-{}h-{}l-{}e-top{}-{}i".format(*shape)
    if (folder / "config.json").is_file():
        return folder
    logger.info("writing a random-init Mixtral-style model to %s (once)", folder)
    tokenizer_dir = resolve_model(None)  # the default model's tokenizer, and its vocabulary size
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = MixtralConfig(vocab_size=vocab, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                           num_hidden_layers=args.num_layers, num_attention_heads=8, num_key_value_heads=4,
                           num_local_experts=args.num_experts, num_experts_per_tok=args.top_k,
                           max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / name).is_file():
            (folder / name).write_bytes((tokenizer_dir / name).read_bytes())
    return folder


def dense_forward(moe: Any, x: Any) -> Any:
    """The baseline: every expert on every token, weighed by the same routing."""
    import torch

    weights, ids = moe.route(x)
    dense = torch.zeros(x.shape[0], moe.num_experts, dtype=x.dtype)
    dense.scatter_(1, ids, weights)
    out = torch.zeros_like(x)
    for expert_id, expert in enumerate(moe.experts):
        out += dense[:, expert_id : expert_id + 1] * expert(x)
    return out


def make_dense(llm: Any) -> int:
    """Switches every MoE layer of ``llm`` to the dense loop; returns how many. A native layer
    (``moe_native.py``) runs it in its own C call (every expert over every token, the same kernels),
    so both engines keep the one-call decode step; else ``dense_forward``."""
    from workers.model.moe import SparseMoE

    layers = [m for m in llm.runner.model.modules() if isinstance(m, SparseMoE)]
    for moe in layers:
        if moe.native is not None:
            moe.native.struct.dense = 1
        else:
            moe.forward = lambda x, moe=moe: dense_forward(moe, x)
    return len(layers)


def run_moe(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    from cluster.bench.latency import engine_decode_step_iter, interleaved_decode, make_prompts
    from workers.llm import LLM

    folder = mixtral_dir(args)
    if args.write_gguf:
        return _write_gguf(folder, Path(args.write_gguf))
    kwargs = {"max_num_seqs": max(args.batch_sizes), **engine_args, "model": str(folder)}
    logger.info("loading %s twice: routed experts and the dense loop", folder.name)
    routed, dense = LLM(**kwargs), LLM(**kwargs)
    make_dense(dense)
    params = routed.runner.weight_bytes // 4  # float32 weights
    rows, report = [], {"model": folder.name, "parameters": params, "engine_args": engine_args, "batches": {}}
    rng = random.Random(0)
    for batch in args.batch_sizes:
        prompts = make_prompts(batch, args.input_len, routed.engine.vocab_size, {0, 1, 2}, rng)
        ours, theirs = interleaved_decode(engine_decode_step_iter(routed, prompts, args.output_len),
                                          engine_decode_step_iter(dense, prompts, args.output_len),
                                          args.interleave_steps)
        a, b = statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3
        report["batches"][batch] = {"routed_step_ms": round(a, 2), "dense_step_ms": round(b, 2),
                                    "speedup": round(b / a, 2)}
        rows.append((str(batch), f"{a:.1f}", f"{b:.1f}", f"{batch / a * 1e3:.1f}", f"{batch / b * 1e3:.1f}",
                     f"{b / a:.2f}x"))
    same = _same_greedy(routed, dense, make_prompts(4, args.input_len, routed.engine.vocab_size, {0, 1, 2}, rng))
    report["same_greedy_tokens"] = same
    for line in format_table([("batch", "routed ms", "dense ms", "routed tok/s", "dense tok/s", "speedup"), *rows]):
        print(line)
    print(f"{folder.name}: {params / 1e6:.0f}M parameters; greedy tokens identical: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        logger.info("wrote %s", args.json)
    return 0 if same else 1


def _write_gguf(folder: Path, path: Path) -> int:
    """The checkpoint as llama.cpp's converter writes a Mixtral GGUF (``moe_gguf.py``), with the default
    model's tokenizer (whose vocabulary the checkpoint has)."""
    import torch
    from transformers import AutoModelForCausalLM

    from cluster.bench import moe_gguf
    from workers.model.loader import default_gguf_path

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    moe_gguf.write_mixtral_gguf(model, path, moe_gguf.copy_tokenizer(default_gguf_path()))
    print(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB); compare with llama.cpp on it:\n"
          f"  prefixserve bench latency --model {path} --compare llama.cpp --peer-weights file "
          "--quantization gguf --batch-sizes 1 8")
    return 0


def _same_greedy(a: Any, b: Any, prompts: list[list[int]]) -> bool:
    from cluster.shared.types import SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in a.generate(prompts, params)] == [o.token_ids for o in b.generate(prompts, params)]
