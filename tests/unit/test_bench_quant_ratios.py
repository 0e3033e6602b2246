"""bench quant's paired ratios: each row against float32 and against llama.cpp's file of its kind, per round."""

from cluster.bench.quant import add_ratios, build_report, format_report, paired_ratios


def _rounds(*b1: float) -> list[dict[str, float]]:
    return [{"gbps": 25.0, "decode_b1": v, "decode_b8": 4 * v, "prefill": 10 * v} for v in b1]


def test_paired_ratios_take_the_median_of_each_rounds_ratio_not_the_ratio_of_medians():
    ours, theirs = _rounds(100.0, 50.0, 200.0), _rounds(50.0, 100.0, 80.0)
    ratios = paired_ratios(ours, theirs)
    assert ratios == {"decode_b1": 2.0, "decode_b8": 2.0, "prefill": 2.0}  # rounds 2.0, 0.5, 2.5; medians: 1.25
    assert "gbps" not in ratios


def test_each_method_is_set_against_llama_cpp_on_the_file_of_its_kind():
    speed = {"none": _rounds(40.0, 40.0), "gguf": _rounds(120.0, 90.0), "w8a8": _rounds(100.0, 100.0),
             "int4-g32": _rounds(100.0, 100.0), "q4_1": _rounds(80.0, 60.0), "q8_0": _rounds(50.0, 80.0)}
    results = {name: {} for name in speed}
    add_ratios(results, speed, peers=["q4_1", "q8_0"])
    assert results["gguf"]["vs_llama_cpp"] == {"peer": "q4_1", "decode_b1": 1.5, "decode_b8": 1.5, "prefill": 1.5}
    assert results["w8a8"]["vs_llama_cpp"]["peer"] == "q8_0"
    assert results["w8a8"]["vs_llama_cpp"]["decode_b1"] == 1.625  # median of 2.0 and 1.25
    assert results["gguf"]["vs_float32"]["decode_b1"] == 2.625  # median of 3.0 and 2.25
    assert "vs_llama_cpp" not in results["none"] and "vs_float32" not in results["none"]
    assert results["q4_1"]["vs_float32"]["decode_b1"] == 1.75 and "vs_llama_cpp" not in results["q4_1"]
    without = {name: {} for name in speed}
    add_ratios(without, speed, peers=["q8_0"])  # Q4_1 not measured: no column for the 4-bit rows
    assert "vs_llama_cpp" not in without["gguf"] and without["w8a8"]["vs_llama_cpp"]["peer"] == "q8_0"


def test_the_table_shows_the_llama_cpp_ratios_and_the_paired_float_ratio():
    report = {"rounds": 3, "batch_sizes": [1, 8],
              "results": {"none": {"decode_b1": 40.0, "decode_b8": 200.0, "prefill": 100.0},
                          "gguf": {"quantization": "gguf", "decode_b1": 130.0, "decode_b8": 400.0, "prefill": 95.0,
                                   "vs_float32": {"decode_b1": 3.1, "decode_b8": 2.0, "prefill": 0.97},
                                   "vs_llama_cpp": {"peer": "q4_1", "decode_b1": 1.37, "decode_b8": 1.73,
                                                    "prefill": 0.82}}}}
    text = "\n".join(format_report(report))
    assert "vs llama.cpp: b1 / b8 / prefill" in text
    assert "Q4_1 1.37x / 1.73x / 0.82x" in text
    assert "130.0 (3.10x)" in text and "95.0 (0.97x)" in text  # the paired ratio, not 130 / 40


def test_the_report_of_the_rounds_so_far_leaves_the_results_as_they_are():
    results = {"none": {"perplexity": 13.9, "_tokens": [[1, 2]]}, "gguf": {"perplexity": 13.9, "_tokens": [[1, 3]]}}
    speed = {"none": _rounds(40.0, 50.0, 30.0), "gguf": _rounds(120.0, 100.0, 60.0), "q4_1": _rounds(100.0, 50.0, 50.0)}
    report = build_report(results, {"gguf": {"mean_tokens_to_divergence": 1.0}}, speed, peers=["q4_1"])
    assert report["rounds"] == 3
    assert "_tokens" in results["gguf"] and "_tokens" not in report["results"]["gguf"]  # a later round needs them
    gguf = report["results"]["gguf"]
    assert gguf["decode_b1"] == 100.0 and gguf["perplexity"] == 13.9 and gguf["agreement"]
    assert gguf["vs_llama_cpp"]["decode_b1"] == 1.2 and gguf["vs_float32"]["decode_b1"] == 2.0  # per round
    assert report["results"]["q4_1"]["quantization"] == "llama.cpp Q4_1"
