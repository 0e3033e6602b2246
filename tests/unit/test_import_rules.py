"""The layers of docs/ARCHITECTURE.md, as import-linter contracts in
pyproject.toml, and every module importable on its own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from tests.factories import import_blocking  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cluster", "workers", "router")


def _lint_imports() -> str:
    beside = Path(sys.executable).parent / "lint-imports"
    exe = str(beside) if beside.is_file() else shutil.which("lint-imports")
    assert exe, "lint-imports is missing: scripts/install.sh installs it (the dev extra)"
    return exe


def test_import_contracts_hold():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout, whatever is installed
    proc = subprocess.run([_lint_imports()], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


def test_contracts_list_no_exceptions():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    types = {c["type"] for c in contracts}
    assert {"layers", "acyclic_siblings", "forbidden"} <= types
    for contract in contracts:
        assert "ignore_imports" not in contract, contract["name"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    assert layers[0] == "cluster.cli" and layers[-1] == "cluster.shared"
    assert "workers | router" in layers  # independent of each other


def test_every_module_imports_on_its_own():
    modules = sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if path.name != "__main__.py"
    )
    assert len(modules) > 100
    # One interpreter per module would take minutes; a fresh interpreter that
    # imports each module after clearing every project module from sys.modules
    # catches a module that only works when something else was imported first.
    code = (
        "import importlib, sys\n"
        f"mods = {modules!r}\n"
        "failed = []\n"
        "for name in mods:\n"
        "    for loaded in [m for m in sys.modules if m.split('.')[0] in ('cluster', 'workers', 'router')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        failed.append(f'{name}: {type(exc).__name__}: {exc}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


def test_engine_control_plane_loads_without_torch():
    # The engine core and the shared base (the router imports it) load where
    # torch, ray and grpc cannot be imported.
    modules = ["workers.engine.engine", "workers.engine.scheduler", "workers.engine.async_engine",
               "cluster.shared.config", "cluster.shared.types", "cluster.shared.hashing"]
    proc = import_blocking(modules, blocked=["torch", "ray", "grpc"], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
