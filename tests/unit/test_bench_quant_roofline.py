"""bench quant's roofline column: each row's weights read at the bandwidth measured before its steps."""

from cluster.bench.quant import format_report, roofline_cell


def test_roofline_cell_sets_the_step_against_the_weight_read():
    row = {"weight_bytes": 100_000_000, "gbps": 25.0, "decode_b1": 125.0}  # floor 4 ms, step 8 ms
    assert roofline_cell(row, 1) == "4.0 ms: 50% (25.0 GB/s)"
    assert roofline_cell({"decode_b1": 125.0}, 1) == "-"  # no bandwidth measured: no cell
    report = {"rounds": 1, "batch_sizes": [1, 8],
              "results": {"none": {"weight_bytes": 540_000_000, "gbps": 27.0, "decode_b1": 40.0, "decode_b8": 200.0,
                                   "prefill": 100.0},
                          "q4_1": {"quantization": "llama.cpp Q4_1", "weight_bytes": 90_000_000, "gbps": 27.0,
                                   "decode_b1": 100.0, "decode_b8": 150.0, "prefill": 60.0}}}
    text = "\n".join(format_report(report))
    assert "b1 roofline" in text and "20.0 ms: 80% (27.0 GB/s)" in text and "3.3 ms: 33% (27.0 GB/s)" in text
