"""Gemma 2's decode step, before and after its soft-capped attention moved into the native decode kernel
(issue 32), interleaved step by step in one process (the machine's drift hits both alike).

    before   the native decoder's per-layer loop, capped decodes in plain torch (``attention/softcap.py``:
             blocks gathered, padded, tanh, softmax), as it was: the backend's native decode off
    after    the one-call decode step (``csrc/decoder_step.c``), the kernel capping scores

A random-init ``Gemma2ForCausalLM`` (transformers' class, float32, sizes below), every request with
``--context`` tokens of context; the model's forward is timed (not the LM head, the same on both).

    .venv/bin/python scripts/gemma2_decode_step.py --batch-sizes 1 8 --context 512 --steps 16
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from workers.model.attention.base import AttentionMetadata
from workers.model.attention.torch_backend import TorchAttentionBackend
from workers.model.loader import load_model


def build_model(folder: str, layers: int):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=4096, hidden_size=1024, intermediate_size=4096, num_hidden_layers=layers,
                          num_attention_heads=8, num_key_value_heads=4, head_dim=128, query_pre_attn_scalar=128,
                          sliding_window=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                          max_position_embeddings=4096, pad_token_id=0)
    torch.manual_seed(0)
    Gemma2ForCausalLM(config).eval().save_pretrained(folder)
    model, _ = load_model(folder, "float32", "cpu", TorchAttentionBackend())
    return model


class Batch:
    """``batch`` requests on their own paged cache, prefilled with ``context`` tokens."""

    def __init__(self, model, batch: int, context: int, steps: int, block_size: int = 16) -> None:
        arch = model.arch
        per_req = -(-(context + steps + 1) // block_size)
        shape = (2, batch * per_req, block_size, arch.num_key_value_heads, arch.head_dim)
        self.caches = [torch.zeros(shape) for _ in range(arch.num_hidden_layers)]
        self.tables = [list(range(r * per_req, (r + 1) * per_req)) for r in range(batch)]
        self.lens = [0] * batch
        self.model, self.block_size = model, block_size
        gen = torch.Generator().manual_seed(batch)
        for r in range(batch):  # one prefill per request
            self._forward({r: torch.randint(3, 4000, (context,), generator=gen).tolist()})

    def _forward(self, chunks: dict[int, list[int]]) -> None:
        ids, positions, slots, qlens, lens, tables = [], [], [], [], [], []
        for r, new in chunks.items():
            for p in range(self.lens[r], self.lens[r] + len(new)):
                positions.append(p)
                slots.append(self.tables[r][p // self.block_size] * self.block_size + p % self.block_size)
            ids += new
            self.lens[r] += len(new)
            qlens.append(len(new))
            lens.append(self.lens[r])
            tables.append(self.tables[r])
        meta = AttentionMetadata.build(slots, qlens, lens, tables)
        with torch.inference_mode():
            self.model(torch.tensor(ids), torch.tensor(positions), self.caches, meta)

    def decode(self) -> float:
        chunks = {r: [5 + r] for r in range(len(self.lens))}
        begin = time.perf_counter()
        self._forward(chunks)
        return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per mode and batch size")
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = build_model(folder, args.layers)
    fast = model.native_decoder
    if fast is None or fast._driver is None:
        raise SystemExit("the native decoder or its one-call step did not build here")
    backend = model.model.layers[0].self_attn.attn_backend
    print(f"{'batch':>5} {'before ms':>10} {'after ms':>10} {'speedup':>8}")
    for batch in args.batch_sizes:
        modes = {"before": Batch(model, batch, args.context, args.steps),
                 "after": Batch(model, batch, args.context, args.steps)}
        times: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(args.steps):
            for name, state in modes.items():  # alternate step by step
                backend._native_decode = name == "after"
                times[name].append(state.decode())
        backend._native_decode = True
        before, after = (statistics.median(times[m]) * 1e3 for m in ("before", "after"))
        print(f"{batch:>5} {before:>10.1f} {after:>10.1f} {before / after:>7.2f}x")


if __name__ == "__main__":
    main()
