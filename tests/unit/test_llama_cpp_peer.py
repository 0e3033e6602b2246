"""The llama.cpp peer of ``bench latency --compare llama.cpp``.

The GGUF writer needs no llama.cpp and always runs. llama-cpp-python is no
project dependency (CI does not install it): the tests that drive llama.cpp
skip without it (install: ``cluster.bench.peer_weights.install_command()``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from cluster.bench import llama_cpp_peer, peer_weights
from cluster.bench.llama_cpp_peer import LlamaCppPeer
from cluster.bench.peer_weights import LlamaCppMissing, default_gguf, peer_gguf, write_gguf

Q = gguf.GGMLQuantizationType
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _tiny_gguf(path: Path, alignment: int = 64) -> dict[str, np.ndarray]:
    """A small llama-like GGUF file: Q8_0, F16 and F32 tensors and assorted metadata.

    Returns the tensors as written (raw: quantized bytes, float16, float32).
    """
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_custom_alignment(alignment)
    writer.add_name("tiny")
    writer.add_block_count(2)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["<|endoftext|>", "a", "b", "Ġc"])
    writer.add_token_types([3, 1, 1, 1])
    writer.add_token_merges(["Ġ c", "a b"])
    writer.add_eos_token_id(0)
    writer.add_chat_template(TEMPLATE)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    tensors = {
        # numpy shape (rows, cols): GGUF stores it as ne = [cols, rows]
        "token_embd.weight": gguf.quants.quantize(rng.standard_normal((6, 64), dtype=np.float32), Q.Q8_0),
        "blk.0.attn_q.weight": gguf.quants.quantize(rng.standard_normal((3, 96), dtype=np.float32), Q.Q8_0),
        "blk.0.ffn_up.weight": rng.standard_normal((5, 7)).astype(np.float16),
        "blk.0.attn_norm.weight": rng.standard_normal(7, dtype=np.float32),
    }
    for name, data in tensors.items():
        writer.add_tensor(name, data, raw_dtype=Q.Q8_0 if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def _fields(reader: gguf.GGUFReader) -> dict[str, tuple[list, object]]:
    return {name: (f.types, f.contents()) for name, f in reader.fields.items() if not name.startswith("GGUF.")}


def test_write_gguf_dequantizes_every_tensor_and_keeps_the_metadata(tmp_path):
    src, dst = tmp_path / "tiny.Q8_0.gguf", tmp_path / "out" / "tiny.F32.gguf"
    written = _tiny_gguf(src)
    assert write_gguf(src, dst) == dst
    assert sorted(p.name for p in dst.parent.iterdir()) == ["tiny.F32.gguf"]  # no temp file left

    before, after = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    assert [t.name for t in after.tensors] == list(written)
    for old, new in zip(before.tensors, after.tensors):
        assert new.tensor_type == Q.F32
        assert new.shape.tolist() == old.shape.tolist()  # GGUF's dims (fastest first) unchanged
        expected = gguf.quants.dequantize(old.data, old.tensor_type)
        assert new.data.dtype == np.float32 and new.data.shape == expected.shape
        np.testing.assert_array_equal(new.data, expected)
    np.testing.assert_array_equal(after.tensors[2].data, written["blk.0.ffn_up.weight"].astype(np.float32))

    fields_before, fields_after = _fields(before), _fields(after)
    assert fields_after.pop("general.file_type")[1] == gguf.LlamaFileType.ALL_F32
    assert fields_before.pop("general.file_type")[1] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert fields_after == fields_before
    assert fields_after["tokenizer.chat_template"][1] == TEMPLATE
    assert fields_after["tokenizer.ggml.tokens"][1] == ["<|endoftext|>", "a", "b", "Ġc"]
    assert after.alignment == 64 and after.data_offset % 64 == 0
    assert all(t.data_offset % 64 == 0 for t in after.tensors)


def test_gguf_file_type_names_the_declared_type(tmp_path):
    src = tmp_path / "tiny.gguf"
    _tiny_gguf(src)
    assert peer_weights.gguf_file_type(src) == "Q8_0"
    assert peer_weights.gguf_file_type(write_gguf(src, tmp_path / "tiny.F32.gguf")) == "F32"


def test_write_gguf_rejects_other_types(tmp_path):
    src = tmp_path / "tiny.gguf"
    _tiny_gguf(src)
    with pytest.raises(ValueError, match="out_type"):
        write_gguf(src, tmp_path / "x.gguf", "q4_0")


def test_peer_gguf_caches_under_peers(tmp_path):
    src = tmp_path / "tiny.Q4_1.gguf"
    _tiny_gguf(src)
    assert peer_gguf("file", tmp_path / "cache", src=src) == src
    with pytest.raises(ValueError, match="is Q8_0, not Q4_1"):
        peer_gguf("q4_1", tmp_path / "cache", src=src)  # the name of a type this file is not
    f32 = peer_gguf("f32", tmp_path / "cache", src=src)
    assert f32.parent == tmp_path / "cache" / "peers" and f32.name.endswith(".F32.gguf")
    stamp = f32.stat().st_mtime_ns
    assert peer_gguf("f32", tmp_path / "cache", src=src) == f32
    assert f32.stat().st_mtime_ns == stamp  # not written again
    with pytest.raises(ValueError, match="kind"):
        peer_gguf("q5_k", tmp_path / "cache", src=src)


def test_missing_llama_cpp_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # any import of it now fails
    src = tmp_path / "tiny.gguf"
    _tiny_gguf(src)
    with pytest.raises(LlamaCppMissing, match="pip install"):
        LlamaCppPeer(src)
    with pytest.raises(LlamaCppMissing, match="pip install"):
        write_gguf(src, tmp_path / "q8.gguf", "q8_0")
    assert not (tmp_path / "q8.gguf").exists()
    assert "llama" in peer_weights.install_command()


# ---------------------------------------------------------------------------
# With llama.cpp (skipped where llama-cpp-python is not installed)


@pytest.fixture(scope="module")
def q4_peer():
    pytest.importorskip("llama_cpp")
    # One thread: ggml's threads spin-wait for each other, and with as many as the
    # cores a concurrently busy process (another test run) makes each step ~100x slower.
    with LlamaCppPeer(default_gguf(), n_threads=1, n_ctx=128, n_seq_max=4, n_batch=64) as peer:
        yield peer


PROMPTS = [
    [1, 4093, 198, 19161, 253, 1345, 17817, 563, 260, 2587, 30, 2, 198, 1, 520, 9531, 198],
    [1, 4093, 198, 19161],
    [504, 3426, 314, 253, 1379, 837, 260, 1035, 6913],
]


def test_greedy_is_repeatable_and_batched_decode_matches_it(q4_peer):
    singles = [q4_peer.greedy(p, 6) for p in PROMPTS]
    assert q4_peer.greedy(PROMPTS[0], 6) == singles[0]
    assert all(len(s) == 6 and all(0 <= t < q4_peer.n_vocab for t in s) for s in singles)
    steps = q4_peer.decode_step_seconds(PROMPTS, 5)
    assert len(steps) == 5 and all(s > 0 for s in steps)
    # One sequence id per prompt, one batch per step: each continues like greedy alone.
    assert q4_peer.last_decoded == singles


def test_prefill_and_limits(q4_peer):
    assert q4_peer.prefill_seconds(PROMPTS[0]) > 0
    with pytest.raises(ValueError):
        q4_peer.prefill_seconds([1] * 65)  # over n_batch
    with pytest.raises(ValueError):
        q4_peer.decode_step_seconds([PROMPTS[1]] * 5, 2)  # over n_seq_max
    with pytest.raises(ValueError):
        q4_peer.decode_step_seconds([PROMPTS[1]], 125)  # over each sequence's n_ctx
    # a prompt longer than n_batch is prefilled in chunks
    assert len(q4_peer.greedy(PROMPTS[0] * 5, 2)) == 2


def test_token_ids_are_our_tokenizers(q4_peer):
    from tokenizers import Tokenizer

    from workers.model.loader import resolve_model

    ours = Tokenizer.from_file(str(resolve_model(None) / "tokenizer.json"))
    text = "<|im_start|>user\nThe capital of France is Paris. Hello, world! 2+2=4 ñ 日本語\t  x<|im_end|>\n"
    assert q4_peer.tokenize(text) == ours.encode(text, add_special_tokens=False).ids


def test_measure_returns_plain_data():
    pytest.importorskip("llama_cpp")
    import json

    result = llama_cpp_peer.measure(default_gguf(), {2: PROMPTS[:2], 1: PROMPTS[:1]}, 3, PROMPTS[0], n_threads=1)
    assert json.loads(json.dumps(result)) == result
    assert [d["batch_size"] for d in result["decode"]] == [1, 2]
    assert all(d["median_step_s"] > 0 and d["decode_tokens_per_s"] > 0 for d in result["decode"])
    assert result["prefill"]["tokens"] == len(PROMPTS[0]) and len(result["prefill"]["runs_s"]) == 3


@pytest.mark.slow
def test_f32_and_q8_0_files_load_and_agree_on_a_short_greedy_run(tmp_path):
    pytest.importorskip("llama_cpp")
    f32 = write_gguf(default_gguf(), tmp_path / "model.F32.gguf")
    q8 = write_gguf(default_gguf(), tmp_path / "model.Q8_0.gguf", "q8_0")
    assert {t.tensor_type for t in gguf.GGUFReader(q8).tensors} <= {Q.Q8_0, Q.F32}
    outs = []
    for path in (f32, q8):
        with LlamaCppPeer(path, n_threads=1, n_ctx=64, n_seq_max=1, n_batch=32) as peer:
            outs.append(peer.greedy(PROMPTS[0], 4))
    assert outs[0][:2] == outs[1][:2]
