"""``prefixserve bench lora``: multi-LoRA decode against the base model, one
interleaved run on the default model.

Adapters: ``--num-adapters`` random PEFT LoRA adapters (rank ``--rank``,
every linear layer: q, k, v, o, gate, up, down; A and B drawn at random,
since PEFT starts B at zero) written with ``peft`` into a temporary folder,
stored in each of ``--adapter-dtypes`` (a fine-tune trained in bfloat16 saves
bfloat16; the engine keeps 16-bit adapters in 16 bits), and the first one
merged into the base weights (``merge_and_unload``) and saved as a plain model.

Engines, each its own :class:`~workers.llm.LLM` (so their batches live side
by side):

    base         the base model as users run it: no ``enable_lora``
    lora-<dtype> ``enable_lora``, batch B: B requests on B different adapters
                 stored in that dtype (batch 1: one adapter)
    lora-idle    ``enable_lora``, the same batch with no adapter (what turning
                 LoRA on costs the base path alone)
    merged       batch 1 only: the first adapter merged into the weights

At each batch size (``--batch-sizes``) their decode steps alternate,
``--interleave-steps`` of each in turn, every batch alive all the while, so
the machine's drift slows each alike and the ratios of the medians hold.
The fastest step of each engine is reported too: on a machine shared with
other work the medians carry waits for the CPU, the fastest steps less so.
A step is one ``engine.step()``. Throughput relative to the base model is
``base step / lora step`` (issue 51's targets: >= 0.8 at batch 8 on 8
adapters, >= 0.9 at batch 1). The load time is one adapter's
``LoRAManager.load`` (read, check, install in every layer), the median of
``--num-loads`` fresh loads (in the first of ``--adapter-dtypes``).

Prints a table, writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional

from cluster.client.table import format_table

logger = logging.getLogger(__name__)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "fp16"}  # --adapter-dtypes: engine name suffix


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8],
                        help="decode batch sizes; batch B runs B requests on B different adapters")
    parser.add_argument("--rank", type=int, default=16, help="rank of every adapter")
    parser.add_argument("--input-len", type=int, default=64, help="prompt tokens of each decoding sequence")
    parser.add_argument("--output-len", type=int, default=32, help="decode steps timed per engine and batch size")
    parser.add_argument("--interleave-steps", type=int, default=4,
                        help="decode steps of one engine before the next one's turn")
    parser.add_argument("--num-loads", type=int, default=5, help="adapter loads timed (median)")
    parser.add_argument("--adapter-dtypes", nargs="+", choices=list(DTYPES), default=["bfloat16", "float32"],
                        help="the adapters' stored dtype; one LoRA engine each, interleaved with the others")
    parser.add_argument("--json", default="bench-results/lora.json", help="where to write the results")


def save_random_adapter(base_dir: Path, out: Path, rank: int, seed: int, merged_out: Optional[Path] = None) -> Path:
    """A PEFT adapter on every linear layer with random A and B (scale 0.02 /
    sqrt(rank): a visible but sane change); with ``merged_out`` also the base
    model with it merged in (``merge_and_unload``) saved as a plain model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * (0.1 / rank ** 0.5))
    model.save_pretrained(out)
    if merged_out is not None:
        model.merge_and_unload().save_pretrained(merged_out)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (base_dir / name).is_file():
                (merged_out / name).write_bytes((base_dir / name).read_bytes())
    return out


def stored_as(src: Path, out: Path, dtype: str) -> Path:
    """``src``'s adapter with its tensors stored in ``dtype`` (``src`` itself for float32)."""
    import torch
    from safetensors.torch import load_file, save_file

    if dtype == "float32":
        return src
    out.mkdir(parents=True)
    (out / "adapter_config.json").write_bytes((src / "adapter_config.json").read_bytes())
    tensors = load_file(str(src / "adapter_model.safetensors"))
    save_file({k: v.to(getattr(torch, dtype)).contiguous() for k, v in tensors.items()},
              str(out / "adapter_model.safetensors"))
    return out


def interleave(iters: dict[str, Iterator[float]], chunk: int) -> dict[str, list[float]]:
    """Runs each iterator ``chunk`` steps in turn, round-robin, to the end of
    all; each round starts one engine later, so none always follows the same one."""
    times: dict[str, list[float]] = {name: [] for name in iters}
    live = dict(iters)
    rounds = 0
    while live:
        names = list(live)
        shift = rounds % len(names)
        rounds += 1
        for name in names[shift:] + names[:shift]:
            for _ in range(chunk):
                step = next(live[name], None)
                if step is None:
                    del live[name]
                    break
                times[name].append(step)
    return times


def run_lora(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    from cluster.bench.latency import engine_decode_step_iter, make_prompts
    from cluster.shared.types import LoRARequest
    from workers.llm import LLM
    from workers.model.loader import resolve_model

    if engine_args.get("model"):
        raise ValueError("bench lora runs the default model: drop --model")
    num_adapters = max(args.batch_sizes)
    base_dir = resolve_model(None)
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        root = Path(tmp)
        logger.info("writing %d random rank-%d adapters (every linear layer) and one merged model to %s",
                    num_adapters, args.rank, root)
        paths = [save_random_adapter(base_dir, root / f"a{i}", args.rank, seed=i,
                                     merged_out=root / "merged" if i == 0 else None) for i in range(num_adapters)]
        requests = {f"lora-{DTYPES[d]}": [LoRARequest(f"a{i}", i + 1, str(stored_as(p, root / d / f"a{i}", d)))
                                          for i, p in enumerate(paths)] for d in args.adapter_dtypes}
        common = {"max_num_seqs": num_adapters, **engine_args}
        lora_args = {**common, "enable_lora": True, "max_loras": num_adapters, "max_lora_rank": args.rank,
                     "max_cpu_loras": num_adapters + 1}
        # Identical engines step slower the earlier they were built (three base engines, interleaved, on this
        # machine: 14.2, 13.4, 12.8 ms at batch 1): the base is built last, so the ratios to it are not flattered.
        logger.info("loading the engines: %s, lora-idle, merged, base", ", ".join(requests))
        engines = {**{name: LLM(**lora_args) for name in requests}, "lora-idle": LLM(**lora_args),
                   "merged": LLM(**{**common, "model": str(root / "merged")}), "base": LLM(**common)}
        report: dict[str, Any] = {"model": base_dir.name, "rank": args.rank, "engine_args": engine_args,
                                  "adapter_dtypes": args.adapter_dtypes, "batches": {}, "fastest": {}}
        rng = random.Random(0)
        for batch in args.batch_sizes:
            prompts = make_prompts(batch, args.input_len, engines["base"].engine.vocab_size, {0, 1, 2}, rng)
            runs = {"base": [None] * batch, **{name: reqs[:batch] for name, reqs in requests.items()},
                    "lora-idle": [None] * batch}
            if batch == 1:
                runs["merged"] = [None]
            logger.info("batch %d: %s, %d decode steps each, %d at a time", batch, ", ".join(runs),
                        args.output_len, args.interleave_steps)
            times = interleave({name: engine_decode_step_iter(engines[name], prompts, args.output_len, loras)
                                for name, loras in runs.items()}, args.interleave_steps)
            report["batches"][batch] = {f"{name}_step_ms": round(statistics.median(t) * 1e3, 2)
                                        for name, t in times.items()}
            report["fastest"][batch] = {f"{name}_step_ms": round(min(t) * 1e3, 2) for name, t in times.items()}
        first = args.adapter_dtypes[0]
        report["load_ms"] = _load_ms(engines[f"lora-{DTYPES[first]}"], root, base_dir, args, first)
    _print_report(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        logger.info("wrote %s", args.json)
    return 0


def _load_ms(llm: Any, root: Path, base_dir: Path, args: argparse.Namespace, dtype: str) -> float:
    """Median ms of ``--num-loads`` fresh loads of one adapter stored in ``dtype`` (new names and folders)."""
    from cluster.shared.types import LoRARequest

    path = stored_as(save_random_adapter(base_dir, root / "load", args.rank, seed=100), root / "load16", dtype)
    seconds = []
    for i in range(args.num_loads):
        copy = root / f"load{i}"
        copy.mkdir()
        for f in path.iterdir():
            (copy / f.name).write_bytes(f.read_bytes())
        llm.engine.lora.load(LoRARequest(f"load{i}", 0, str(copy)))
        seconds.append(llm.engine.lora.last_load_s)
    logger.info("adapter loads: %s ms", ", ".join(f"{s * 1e3:.0f}" for s in seconds))
    return round(statistics.median(seconds) * 1e3, 1)


def _print_report(report: dict[str, Any]) -> None:
    rows = [("batch", "engine", "step ms", "tok/s", "vs base", "fastest ms", "vs base")]
    for batch, figures in report["batches"].items():
        base, fastest = figures["base_step_ms"], report["fastest"][batch]
        for key, ms in list(figures.items()):
            name = key.removesuffix("_step_ms")
            low = fastest[key]
            rows.append((str(batch), name, f"{ms:.1f}", f"{batch / ms * 1e3:.1f}", f"{base / ms:.2f}x", f"{low:.1f}",
                         f"{fastest['base_step_ms'] / low:.2f}x"))
            if name != "base":
                figures[f"{name}_vs_base"] = round(base / ms, 3)
                fastest[f"{name}_vs_base"] = round(fastest["base_step_ms"] / low, 3)
    for line in format_table(rows):
        print(line)
    print(f"{report['model']}, rank {report['rank']} adapters on every linear layer, stored as "
          f"{' / '.join(report['adapter_dtypes'])}; one {report['adapter_dtypes'][0]} adapter loads in "
          f"{report['load_ms']:.0f} ms (median)")
