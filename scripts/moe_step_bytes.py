"""The weight bytes a decode step of ``bench moe``'s model reads, routed against the dense loop, and the
step-time ratio that read alone allows at the read bandwidth measured here (issue 32's MoE bullet).

At a decode step each expert that some token of the batch chose is read whole, once (its gate/up and
down), whichever of its tokens' rows it then computes; the dense loop reads every expert. The rest
(attention, router, LM head) is read by both. So on a machine where the step is the weights' read,
routed / dense can be no faster than ``dense bytes / routed bytes``. This counts the experts the
router actually picks at each step (the same routing function as the native layer), per layer, and
times the MoE layers alone, routed and dense interleaved: the same GB/s on both means both are
read-bound, and the ratio is the bytes'.

    .venv/bin/python scripts/moe_step_bytes.py --batch-size 8 --steps 16 [--quantization int4]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def read_bytes(linear) -> int:
    """What the linear's kernel reads per call: its quantized or packed weight (else the float one)."""
    if linear.quant is not None:
        return int(linear.quant.nbytes)
    if linear.packed is not None:
        tensors = [linear.packed.panels] + ([linear.packed.bias] if linear.packed.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)
    return linear.weight.numel() * linear.weight.element_size()


def main() -> None:
    from cluster.bench import moe as bench_moe
    from cluster.bench.latency import engine_decode_step_iter, make_prompts
    from cluster.bench.roofline import measure_read_gbps
    from workers.llm import LLM
    from workers.model.linear import Linear
    from workers.model.moe import SparseMoE

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_moe.add_moe_args(parser)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--layer-reps", type=int, default=30, help="rounds of the MoE layers timed alone")
    args = parser.parse_args()
    llm = LLM(model=str(bench_moe.mixtral_dir(args)), max_num_seqs=args.batch_size, quantization=args.quantization)
    model = llm.runner.model
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    expert_ids = {id(lin) for moe in layers for lin in moe.experts.modules() if isinstance(lin, Linear)}
    expert_bytes = sum(read_bytes(lin) for lin in layers[0].experts[0].modules() if isinstance(lin, Linear))
    other = sum(read_bytes(m) for m in model.modules() if isinstance(m, Linear) and id(m) not in expert_ids)
    active: list[int] = []  # distinct experts chosen, per (step, layer)

    def count(moe, inputs):
        _, ids = moe.route(inputs[0])
        active.append(int(torch.unique(ids).numel()))

    hooks = [moe.register_forward_pre_hook(count) for moe in layers]
    fast, model.native_decoder = model.native_decoder, None  # the one-call step skips module hooks
    prompts = make_prompts(args.batch_size, args.input_len, llm.engine.vocab_size, {0, 1, 2}, random.Random(0))
    for _ in engine_decode_step_iter(llm, prompts, args.steps):  # counted by the hooks, not timed
        pass
    model.native_decoder = fast
    for hook in hooks:
        hook.remove()
    decode = active[-args.steps * len(layers):]  # the decode steps' (the prefill's came first)
    mean_active = statistics.mean(decode)
    num_experts = layers[0].num_experts
    routed = other + len(layers) * mean_active * expert_bytes
    dense = other + len(layers) * num_experts * expert_bytes
    routed_ms, dense_ms = time_layers(layers, args.batch_size, args.layer_reps)
    gbps = measure_read_gbps()
    print(f"batch {args.batch_size}, top-{layers[0].top_k} of {num_experts} experts, {len(layers)} MoE layers, "
          f"quantization {args.quantization}")
    uniform = num_experts * (1 - (1 - layers[0].top_k / num_experts) ** args.batch_size)
    print(f"experts chosen per layer and step: mean {mean_active:.2f} (min {min(decode)}, max {max(decode)}); "
          f"uniform routing would give {uniform:.2f}")
    print(f"one expert {expert_bytes / 2**20:.2f} MiB; the rest of the model {other / 2**20:.1f} MiB a step")
    print(f"bytes a step: routed {routed / 2**20:.1f} MiB, dense {dense / 2**20:.1f} MiB -> read-bound ceiling "
          f"of routed vs dense {dense / routed:.2f}x")
    print(f"read bandwidth measured now {gbps:.2f} GB/s: read floors routed {routed / gbps / 1e6:.1f} ms, dense "
          f"{dense / gbps / 1e6:.1f} ms a step (compare bench moe's step times)")
    experts_routed = len(layers) * mean_active * expert_bytes  # what the layers alone read, on average
    experts_dense = len(layers) * num_experts * expert_bytes
    print(f"the {len(layers)} MoE layers alone (moe_forward_f32, batch {args.batch_size} of random rows, "
          f"{args.layer_reps} interleaved rounds, fastest): routed {routed_ms:.1f} ms "
          f"(~{experts_routed / routed_ms / 1e6:.1f} GB/s), dense {dense_ms:.1f} ms "
          f"({experts_dense / dense_ms / 1e6:.1f} GB/s): {dense_ms / routed_ms:.2f}x")


def time_layers(layers, batch: int, reps: int) -> tuple[float, float]:
    """The fastest of ``reps`` rounds of every MoE layer's native call (routed, then dense: its ``dense``
    flag) on one batch of random rows, in ms; the rounds alternate, so drift hits both."""
    x = torch.randn(batch, layers[0].gate.in_features, generator=torch.Generator().manual_seed(1))
    times: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(reps):
        for dense in (0, 1):
            for moe in layers:
                moe.native.struct.dense = dense
            begin = time.perf_counter()
            for moe in layers:
                moe.native.forward(x)
            times[dense].append((time.perf_counter() - begin) * 1e3)
    for moe in layers:
        moe.native.struct.dense = 0
    return min(times[0]), min(times[1])


if __name__ == "__main__":
    main()
