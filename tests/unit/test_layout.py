"""The house rules a newcomer relies on: Python modules small enough to read
(about 400 lines at most, generated code aside) and native kernels in C
files of their own, never in Python strings (``workers/model/csrc``)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("cluster", "workers", "router", "scripts", "tests")
GENERATED = ("router/pb",)  # protoc's stubs (scripts/gen_proto.py)
MAX_LINES = 400
C_MARKERS = ("#" + "include", "__" + "m256", "__" + "m512")  # split: this file must not match itself


def _modules() -> list[Path]:
    out = []
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(GENERATED):
                out.append(path)
    assert len(out) > 200, "the scan found too few modules: is ROOT right?"
    return out


def test_no_python_module_is_over_the_line_limit():
    long = {p.relative_to(ROOT).as_posix(): n for p in _modules()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, (f"modules over {MAX_LINES} lines (split them by responsibility; docs/ARCHITECTURE.md "
                      f"has the layout): {long}")


def test_no_c_in_python_strings():
    found = {p.relative_to(ROOT).as_posix(): marker for p in _modules() for marker in C_MARKERS
             if marker in p.read_text()}
    assert not found, f"C source belongs in workers/model/csrc/*.c (loaded by native.source), found: {found}"


def test_every_kernel_source_is_package_data():
    csrc = ROOT / "workers" / "model" / "csrc"
    sources = sorted(p.name for p in csrc.iterdir() if p.suffix in (".c", ".h"))
    assert len(sources) >= 7, sources
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"workers.model" = ["csrc/*.c", "csrc/*.h"]' in pyproject
