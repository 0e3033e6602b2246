"""bench latency's report: the weight-read roofline line."""


def test_bench_latency_roofline_line():
    from cluster.bench.latency import format_report, roofline

    decode = {"1": {"step_ms": 0.5, "tokens_per_s": 2000.0}, "32": {"step_ms": 1.0, "tokens_per_s": 32000.0}}
    line = roofline(decode, 540_000_000, 4.8)
    assert line["floor_ms"] == 0.1125  # 540 MB at 4.8 TB/s
    assert line["fraction"] == {"1": 0.225, "32": 0.113}
    report = {"prefixserve": {"decode": decode}, "load_seconds": 1, "warmup_seconds": 1, "threads": 2, "rounds": 1,
              "weight_bytes": 540_000_000, "roofline": line}
    text = "\n".join(format_report(report))
    assert "weight-read roofline at 4.8 TB/s: 0.113 ms a step (0.54 GB); reached 22% at batch 1, 11% at batch 32" \
        in text


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
