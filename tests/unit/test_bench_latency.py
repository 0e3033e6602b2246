"""bench latency: the weight-read roofline line, interleaving, and llama.cpp's file for --model."""


def test_bench_latency_roofline_line():
    from cluster.bench.latency import format_report
    from cluster.bench.roofline import roofline

    decode = {"1": {"step_ms": 0.5, "tokens_per_s": 2000.0}, "32": {"step_ms": 1.0, "tokens_per_s": 32000.0}}
    line = roofline(decode, 540_000_000, 4800.0, measured=False)
    assert line["floor_ms"] == 0.1125  # 540 MB at 4.8 TB/s
    assert line["fraction"] == {"1": 0.225, "32": 0.113}
    report = {"prefixserve": {"decode": decode}, "load_seconds": 1, "warmup_seconds": 1, "threads": 2, "rounds": 1,
              "weight_bytes": 540_000_000, "roofline": line}
    text = "\n".join(format_report(report))
    assert "roofline: 540.0 MB of weights a step over 4800.0 GB/s (given)" in text
    assert "floor 0.11 ms: 22%" in text and "floor 0.11 ms: 11%" in text  # next to each step


def test_bench_latency_roofline_measured_with_llama_cpp_beside():
    from cluster.bench.latency import format_report
    from cluster.bench.roofline import measure_read_gbps, roofline

    assert measure_read_gbps(buffer_mib=8, repeats=1) > 0
    decode = {"1": {"step_ms": 8.0, "tokens_per_s": 125.0}}
    peer = {"decode": {"1": {"step_ms": 10.0, "tokens_per_s": 100.0}}, "weights": "Q4_1", "greedy_agreement": "32/32"}
    line = roofline(decode, 100_000_000, 25.0, measured=True, peer=(peer["decode"], 90_000_000),
                    gbps_rounds=[24.0, 25.0, 26.0])
    assert line["fraction"] == {"1": 0.5} and line["peer"]["fraction"] == {"1": 0.36}
    report = {"prefixserve": {"decode": decode}, "llama.cpp": peer, "load_seconds": 1, "warmup_seconds": 1,
              "threads": 2, "rounds": 3, "interleave_steps": 8, "weight_bytes": 100_000_000, "roofline": line}
    text = "\n".join(format_report(report))
    assert "floor 4.00 ms: 50% (llama.cpp 3.60 ms: 36%)" in text
    assert "25.0 GB/s measured in this run (median of rounds: 24.0, 25.0, 26.0)" in text


def test_interleaved_decode_alternates_in_chunks_to_the_end_of_both():
    from cluster.bench.latency import interleaved_decode

    order = []

    def steps(name, n):
        for i in range(n):
            order.append(name)
            yield float(i)

    ours, theirs = interleaved_decode(steps("a", 5), steps("b", 9), chunk=2)
    assert ours == [0.0, 1.0, 2.0, 3.0, 4.0] and theirs == [float(i) for i in range(9)]
    assert "".join(order) == "aabbaabbabbbbb"


def test_peer_file_is_the_models_own_gguf_or_made_from_it(tmp_path, monkeypatch):
    """--compare llama.cpp on any GGUF model (a packaged one such as gemma3-270m,
    a .gguf path, the default): llama.cpp's file comes from that model's file."""
    import pytest

    from cluster.bench import peer_weights
    from cluster.bench.latency import peer_file
    from workers.model import loader
    from workers.model.packaged import PACKAGED_MODELS

    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "model.Q4_K_M.gguf"
    src.write_bytes(b"GGUF")
    seen = []

    def fake_peer_gguf(kind, cache_dir, src=None):
        seen.append((kind, cache_dir, src))
        return src if kind == "file" else cache_dir / "peers" / f"made.{kind.upper()}.gguf"

    monkeypatch.setattr(peer_weights, "peer_gguf", fake_peer_gguf)
    assert peer_file(str(src), "file") == src
    assert peer_file(str(src), "f32") == tmp_path / "cache" / "peers" / "made.F32.gguf"
    assert seen[-1] == ("f32", tmp_path / "cache", src)

    name = next(n for n in PACKAGED_MODELS if n != "smollm2-135m")  # gemma3-270m
    monkeypatch.setattr(loader, "packaged_gguf_path", lambda n: src if n == name else None)
    assert peer_file(name, "q8_0").name == "made.Q8_0.gguf" and seen[-1][2] == src
    monkeypatch.setattr(loader, "default_gguf_path", lambda: tmp_path / "default.gguf")
    assert peer_file(None, "file") == tmp_path / "default.gguf"

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not one: pass a .gguf file, a packaged model"):
        peer_file(str(folder), "f32")
