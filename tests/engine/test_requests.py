"""End to end on real models: sampling knobs, stops, logprobs, bad input, the
async front and the CLI."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys

import pytest
import torch

from cluster.bench import offline as bench
from cluster.shared.types import FinishReason, GenerationRequest, SamplingParams
from tests.factories import make_tiny_model_dir
from tests.unit.engine_fakes import assert_all_blocks_free_or_cached
from workers.engine.async_engine import AsyncEngine
from workers.llm import LLM


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model_dir("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return LLM(str(tiny_dir), block_size=4)


@pytest.fixture(scope="module")
def smol():
    return LLM(block_size=16, max_model_len=512)


def sampled(seed, n=12):
    return SamplingParams(max_tokens=n, temperature=1.0, top_p=0.9, top_k=50, seed=seed, ignore_eos=True)


def test_seeded_request_is_the_same_alone_and_in_any_batch(tiny):
    prompt = list(range(10, 30))
    alone = tiny.generate([prompt], sampled(7))[0].token_ids
    others = [list(range(40 + i, 60 + 2 * i)) for i in range(5)]
    batch = tiny.generate(others[:3] + [prompt] + others[3:], [sampled(i) for i in range(3)] + [sampled(7)]
                          + [SamplingParams(max_tokens=9, temperature=0.8)] * 2)
    assert batch[3].token_ids == alone
    assert tiny.generate([prompt], sampled(8))[0].token_ids != alone
    assert_all_blocks_free_or_cached(tiny.engine.scheduler)


def test_seeded_request_survives_preemption(tiny_dir):
    prompts = [list(range(5 + i, 40 + i)) for i in range(6)]
    params = [sampled(100 + i, 20) for i in range(6)]
    roomy = LLM(str(tiny_dir), block_size=4).generate(prompts, params)
    tight = LLM(str(tiny_dir), block_size=4, num_kv_blocks=20, preemption_mode="recompute")
    squeezed = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions_total > 0
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in roomy]


def test_logprobs_are_the_raw_distribution(tiny):
    out = tiny.generate([list(range(3, 20))], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3))[0]
    assert len(out.logprobs) == 4
    for token, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token
        assert len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0][0] == token  # greedy picks the most likely
        assert lp.logprob == pytest.approx(lp.top_logprobs[0][1])
        assert all(a[1] >= b[1] for a, b in zip(lp.top_logprobs, lp.top_logprobs[1:]))
        assert sum(math.exp(v) for _, v in lp.top_logprobs) <= 1.0 + 1e-5


def test_stop_token_ids_and_max_tokens(tiny):
    prompt = list(range(50, 70))
    free = tiny.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert free.finish_reason == FinishReason.LENGTH and len(free.token_ids) == 10
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    out = tiny.generate([prompt], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == FinishReason.STOP
    assert out.token_ids == free.token_ids[: first + 1]


def test_stop_strings_cut_the_text(smol):
    prompt = "The capital of France is"
    free = smol.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    stop = free.text.strip().split()[2]
    out = smol.generate([prompt], SamplingParams(max_tokens=24, temperature=0, stop=[stop]))[0]
    assert out.finish_reason == FinishReason.STOP
    assert out.text == free.text[: free.text.index(stop)]
    assert stop not in out.text


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ("", SamplingParams(), "prompt is empty"),
        ([], SamplingParams(), "prompt is empty"),
        (list(range(600)), SamplingParams(), "max_model_len is 512"),
        ([1, 2, 10**6], SamplingParams(), "outside the vocabulary"),
    ],
)
def test_bad_input_is_rejected_and_the_engine_keeps_serving(smol, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        smol.generate(["Hello", prompt], params)
    out = smol.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3
    assert_all_blocks_free_or_cached(smol.engine.scheduler)


def test_async_stream_cancel_returns_every_block(tiny):
    front = AsyncEngine(tiny.engine)
    kv = tiny.engine.scheduler.kv_manager

    async def main():
        stream = front.generate(GenerationRequest("c1", list(range(3, 60)), SamplingParams(max_tokens=200)))
        got = 0
        async for out in stream:
            got += len(out.new_token_ids)
            if got >= 5:
                usage = front.stats.kv_cache_usage
                await stream.aclose()
                return usage

    try:
        usage_mid_stream = asyncio.run(main())
        assert usage_mid_stream > 0
        for _ in range(200):
            if not tiny.engine.has_unfinished_requests():
                break
            asyncio.run(asyncio.sleep(0.01))
    finally:
        front.shutdown()
    assert kv.device_pool.num_used_blocks == 0
    assert_all_blocks_free_or_cached(tiny.engine.scheduler)


def test_cli_generate_streams_text(tiny_dir):
    # The default model through the console entry point, greedy and short.
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "generate", "--chat", "What is the capital of France?",
         "--max-tokens", "12", "--max-model-len", "256", "--kv-cache-memory", "0.05"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "finish_reason=" in proc.stderr


def test_cli_rejects_a_misspelled_engine_flag():
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "generate", "hi", "--max-num-seq", "4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--max-num-seqs" in proc.stderr


def test_bench_offline_counts_what_it_asked_for(tiny_dir, tmp_path):
    out_json = tmp_path / "bench.json"
    args = ["--num-prompts", "6", "--min-input-len", "4", "--max-input-len", "40", "--min-output-len", "2",
            "--max-output-len", "9", "--hf-batch-size", "4", "--prefix-len", "16", "--workload-seed", "3"]
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "bench", "offline", *args, "--model", str(tiny_dir),
         "--block-size", "4", "--json", str(out_json)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out_json.read_text())
    workload = bench.make_workload(
        argparse.Namespace(num_prompts=6, min_input_len=4, max_input_len=40, min_output_len=2, max_output_len=9,
                           workload_seed=3), 512, {0, 1, 2})
    expected_tokens = sum(workload.output_lens)
    runs = {r["name"].split("(")[0]: r for r in report["runs"]}
    assert runs["prefixserve"]["output_tokens"] == runs["hf-generate"]["output_tokens"] == expected_tokens
    assert report["throughput_ratio"] > 0
    assert report["prefix_cache"]["num_cached_tokens"] == 16
    assert "throughput ratio" in proc.stdout


def test_cli_chat_keeps_the_conversation():
    # The second turn only makes sense with the first in the history.
    proc = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "chat", "--max-tokens", "20", "--max-model-len", "512",
         "--kv-cache-memory", "0.05"],
        input="What is the capital of France?\nAnd of Italy?\n", capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.strip().splitlines()[:2]
    assert "Paris" in first
    assert "Rome" in second


def test_prompt_logprobs_match_transformers_across_chunks_and_skip_the_prefix_cache(tiny_dir):
    import torch
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny_dir), block_size=4, max_num_batched_tokens=16, max_num_seqs=4, enable_chunked_prefill=True)
    prompt = [(7 * i) % 200 + 3 for i in range(45)]  # three chunks of at most 16
    llm.generate([prompt], SamplingParams(max_tokens=1))  # caches its blocks
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    out, plain = llm.generate([prompt, prompt[:20]], [params, SamplingParams(max_tokens=2)])
    assert out.num_cached_tokens == 0  # computed in full, though its blocks were cached
    assert plain.prompt_logprobs is None
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    got = out.prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    for i, entry in enumerate(got[1:], start=1):
        assert entry.token_id == prompt[i]
        assert abs(entry.logprob - ref[i - 1, prompt[i]].item()) < 1e-4
        assert [t for t, _ in entry.top_logprobs] == ref[i - 1].topk(3).indices.tolist()
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=-1)
    assert_all_blocks_free_or_cached(llm.engine.scheduler)


def test_int8_kv_cache_holds_more_blocks_and_survives_swapping(tiny_dir):
    prompts = [list(range(5 + i, 40 + i)) for i in range(6)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    floats = LLM(str(tiny_dir), block_size=4, kv_cache_memory=0.002)
    int8 = LLM(str(tiny_dir), block_size=4, kv_cache_memory=0.002, kv_cache_dtype="int8")
    head_dim = int8.runner.kv_caches[0].shape[-1] - 4
    assert int8.runner.kv_caches[0].dtype == torch.int8
    # float32 rows of 4 * head_dim bytes against head_dim + 4 (values, then the scale).
    assert int8.runner.num_kv_blocks >= floats.runner.num_kv_blocks * (4 * head_dim) // (head_dim + 4) - 1
    roomy = int8.generate(prompts, params)
    ref = floats.generate(prompts, params)
    # Close to the float cache: the first tokens agree, logprobs within quantization error.
    assert [o.token_ids[0] for o in roomy] == [r.token_ids[0] for r in ref]
    assert max(abs(o.logprobs[0].logprob - r.logprobs[0].logprob) for o, r in zip(roomy, ref)) < 0.05
    # Swapped out and back in, int8 rows (values and scales) come back intact: the same tokens.
    tight = LLM(str(tiny_dir), block_size=4, num_kv_blocks=20, kv_cache_dtype="int8", preemption_mode="swap")
    squeezed = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions_total > 0
    assert [o.token_ids for o in squeezed] == [o.token_ids for o in roomy]
    assert_all_blocks_free_or_cached(tight.engine.scheduler)
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'int8'\)"):
        LLM(str(tiny_dir), kv_cache_dtype="fp8")
