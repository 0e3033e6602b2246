"""Native CPU kernels: plain C compiled on first use with the system's ``cc``
into the prefixserve cache folder and loaded with ctypes (which releases the
GIL during a call).

Sources live as C files in ``csrc/`` beside this module (package data):
``source(name)`` reads one and writes each of its local includes (a
quoted header of ``csrc/``) out in full (shared pieces, such as the vector ``exp`` of several
kernels), so the text that is hashed and compiled is the whole kernel and a
changed header rebuilds what includes it.

A kernel is built once per source, flags and machine (the digest names the
file, so concurrent builders agree and a changed source rebuilds). No
compiler, or a failed build, returns None: callers fall back to torch and
nothing else changes. ``-march=native`` makes the build fit the CPU it runs
on (AVX2 / AVX-512); the cache folder is per machine.

OpenMP: torch's CPU wheel ships ``libgomp.so.1``; once torch is loaded, our
libraries bind to that same runtime by soname, so kernels and torch ops share
one thread pool instead of two pools spinning against each other.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Optional, Sequence

from cluster.shared.cache import cache_root

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
_lock = threading.Lock()
_loaded: dict[str, Optional[ctypes.CDLL]] = {}


CSRC = Path(__file__).resolve().parent / "csrc"
_LOCAL_INCLUDE = re.compile(r'^#\s*include "([A-Za-z0-9_.]+)"$', re.MULTILINE)


def source(name: str) -> str:
    """The C text of ``csrc/<name>``, its local includes written out (recursively)."""
    text = (CSRC / name).read_text()
    return _LOCAL_INCLUDE.sub(lambda m: source(m.group(1)), text)


def cache_dir() -> Path:
    """Where built kernels live (``$PREFIXSERVE_CACHE_DIR/kernels``)."""
    return cache_root() / "kernels"


def _cpu_id() -> str:
    """What the build depends on beyond the source: the CPU's model and flags."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor()


Signatures = dict[str, list[Any]]  # function name -> argtypes (restype: void)


def build(name: str, source: str, flags: Sequence[str] = FLAGS,
          signatures: Optional[Signatures] = None) -> Optional[ctypes.CDLL]:
    """Builds (once per source, flags and CPU) and loads ``source`` as ``name``;
    each call after the first returns the same library.

    Args:
        signatures: ``{function: argtypes}`` of the void functions to declare
            once the library is loaded.

    Returns:
        The library, or None when no C compiler is found or the build fails
        (logged once per process).
    """
    digest = hashlib.sha256((source + " ".join(flags) + os.uname().machine + _cpu_id()).encode()).hexdigest()[:16]
    key = f"{name}_{digest}"
    with _lock:
        if key not in _loaded:
            lib = _build_and_load(name, key, source, flags)
            for function, argtypes in (signatures or {}).items():
                if lib is not None:
                    fn = getattr(lib, function)
                    fn.restype, fn.argtypes = None, argtypes
            _loaded[key] = lib
        return _loaded[key]


def _build_and_load(name: str, key: str, source: str, flags: Sequence[str]) -> Optional[ctypes.CDLL]:
    target = cache_dir() / f"{key}.so"
    if not target.exists():
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if cc is None:
            logger.info("no C compiler found: the native %s kernel is off, torch serves instead", name)
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            src = Path(tmp) / f"{name}.c"
            src.write_text(source)
            built = Path(tmp) / target.name
            proc = subprocess.run([cc, *flags, str(src), "-o", str(built), "-lm"], capture_output=True, text=True)
            if proc.returncode != 0:
                logger.warning("building the native %s kernel failed; torch serves instead:\n%s",
                               name, proc.stderr[-2000:])
                return None
            os.replace(built, target)  # atomic: concurrent builders agree
    return ctypes.CDLL(str(target))
