"""Every third-party module the code, the scripts and the tests import comes
from a dependency that pyproject.toml declares (directly, not by luck of
another package's requirements)."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
OWN = {"cluster", "workers", "router", "tests"}
# Modules of optional extras that need not be installed here (GPU, Python 3.10 only).
NOT_INSTALLED = {"flash_attn": "flash-attn", "tomli": "tomli"}
# Benchmark peers, imported lazily by the benchmarks and never installed by the project
# (bench latency --compare llama.cpp; the wheel is in ../shared/peers).
PEERS = {"llama_cpp"}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"]) + [s for extra in project["optional-dependencies"].values() for s in extra]
    return {_normalize(re.match(r"[A-Za-z0-9_.-]+", spec).group(0)) for spec in specs}


def _imported_modules() -> dict[str, set[str]]:
    scripts = {p.stem for p in (ROOT / "scripts").glob("*.py")}
    found: dict[str, set[str]] = {}
    for folder in ("cluster", "workers", "router", "scripts", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in OWN | PEERS and top not in sys.stdlib_module_names and top not in scripts:
                        found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_imported_module_is_declared():
    declared = _declared()
    owners = metadata.packages_distributions()
    undeclared = {}
    for module, files in sorted(_imported_modules().items()):
        dists = {_normalize(d) for d in owners.get(module, ())} or {NOT_INSTALLED.get(module, f"<{module}>")}
        if not dists & declared:
            undeclared[module] = (sorted(dists), sorted(files)[:3])
    assert not undeclared, f"declare these in pyproject.toml: {undeclared}"
