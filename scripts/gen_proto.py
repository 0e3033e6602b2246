#!/usr/bin/env python3
"""Regenerates the Python stubs of ``proto/`` into ``router/pb/``.

Usage: ``python scripts/gen_proto.py [--out DIR]`` (default: ``router/pb``).

``grpc_tools.protoc`` writes ``prefixserve/v1/generation_pb2*.py``; the files
are moved flat into the output folder and their imports rewritten to
``router.pb``, so the stubs import as ``router.pb.generation_pb2`` while the
descriptor keeps its canonical name ``prefixserve/v1/generation.proto`` (what
server reflection and other-language clients see). ``proto/`` itself is never
an importable package: ``ray[serve]`` installs proto-plus, whose top-level
module is ``proto``.

``tests/unit/test_proto_stubs.py`` runs this into a temporary folder and
fails when the committed stubs differ.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
PROTO_FILES = ("prefixserve/v1/generation.proto",)
PACKAGE = "router.pb"
SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")

logger = logging.getLogger("gen_proto")


def generate(out_dir: Path) -> list[Path]:
    """Generates the stubs of every file in ``PROTO_FILES`` into ``out_dir``.

    Args:
        out_dir: Destination folder (created if missing); existing stubs of
            the same names are overwritten.

    Returns:
        The files written.

    Raises:
        RuntimeError: protoc failed (its message is logged).
    """
    from grpc_tools import protoc  # dev dependency: only the generator needs it

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--pyi_out={tmp}",
            *(str(PROTO_ROOT / name) for name in PROTO_FILES),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        for name in PROTO_FILES:
            rel_dir = Path(name).parent
            stem = Path(name).stem
            source_module = ".".join(rel_dir.parts + (f"{stem}_pb2",))
            for suffix in SUFFIXES:
                src = Path(tmp) / rel_dir / f"{stem}{suffix}"
                text = _rewrite(src.read_text(), ".".join(rel_dir.parts), source_module, stem)
                dest = out_dir / src.name
                dest.write_text(text)
                written.append(dest)
    return written


def _rewrite(text: str, proto_package_path: str, source_module: str, stem: str) -> str:
    """Points generated imports and module names at ``router.pb``."""
    # generation_pb2_grpc.py: `from prefixserve.v1 import generation_pb2 as ...`
    text = text.replace(f"from {proto_package_path} import {stem}_pb2", f"from {PACKAGE} import {stem}_pb2")
    # generation_pb2.py: the module name classes report (pickling by reference needs it importable)
    return text.replace(f"'{source_module}'", f"'{PACKAGE}.{stem}_pb2'")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "router" / "pb", help="output folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for path in generate(args.out):
        logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
