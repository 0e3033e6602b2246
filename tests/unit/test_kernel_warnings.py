"""Every native kernel (``workers/model/csrc``) compiles without a single
warning under ``-Wall -Wextra -Werror``, for each instruction set its code
has a path for: AVX2 + FMA (``haswell``: the AMD EPYC machines), AVX-512F/BW
(``skylake-avx512``) and AVX-512 with VNNI (``icelake-server``: Zen 4 and
recent Intel), with the flags its module builds it with. The check itself is
shown to fail on a deliberately introduced warning."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from workers.model import native
from workers.model import cpu_ops, moe_native
from workers.model.attention import cpu_decode, cpu_prefill

CC = shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler here")

ARCHES = ("-march=haswell", "-march=skylake-avx512", "-march=icelake-server")
# (source file, the flags its module builds it with, extra variants)
KERNELS = [
    ("cpu_ops.c", cpu_ops._FLAGS, [()]),
    ("gemm_f32.c", native.FLAGS, [()]),
    ("i8gemm_f32.c", native.FLAGS, [()]),
    ("qgemm_f32.c", native.FLAGS, [()]),
    ("decoder_step.c", native.FLAGS, [()]),
    ("lora_f32.c", native.FLAGS, [()]),
    ("moe_f32.c", moe_native._FLAGS, [()]),
    ("paged_decode.c", cpu_decode._FLAGS, [(), ("-DKV_INT8",)]),
    ("paged_prefill.c", cpu_prefill._FLAGS, [()]),
]
STRICT = ("-Wall", "-Wextra", "-Werror")


def compile_strict(text: str, flags, arch: str, tmp: Path) -> subprocess.CompletedProcess:
    src = tmp / "kernel.c"
    src.write_text(text)
    build = [f for f in flags if f not in ("-march=native", "-shared")]
    return subprocess.run([CC, *build, arch, *STRICT, "-c", str(src), "-o", str(tmp / "kernel.o")],
                          capture_output=True, text=True)


def test_every_source_in_csrc_is_a_kernel_here():
    assert {p.name for p in native.CSRC.glob("*.c")} == {name for name, _, _ in KERNELS}


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("name, flags, variants", KERNELS, ids=[k[0] for k in KERNELS])
def test_kernel_compiles_without_warnings(name, flags, variants, arch, tmp_path):
    for extra in variants:
        result = compile_strict(native.source(name), (*flags, *extra), arch, tmp_path)
        assert result.returncode == 0, f"{name} {arch} {extra}:\n{result.stderr[-3000:]}"


def test_a_warning_fails_the_check(tmp_path):
    broken = native.source("cpu_ops.c") + "\nint prefixserve_unused_probe(int x) { int unused; return x; }\n"
    result = compile_strict(broken, cpu_ops._FLAGS, ARCHES[0], tmp_path)
    assert result.returncode != 0 and "unused" in result.stderr
