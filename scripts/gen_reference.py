"""Writes docs/CONFIG.md, the configuration reference, from the config
dataclasses and the ``prefixserve`` parser (``cluster/cli/reference.py``).

    .venv/bin/python scripts/gen_reference.py

``tests/unit/test_docs.py`` fails while the committed page differs from what
this writes.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cluster.cli.reference import config_reference  # noqa: E402

logger = logging.getLogger("gen_reference")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = ROOT / "docs" / "CONFIG.md"
    text = config_reference()
    changed = not path.is_file() or path.read_text() != text
    path.write_text(text)
    logger.info("%s %s (%d lines)", "wrote" if changed else "unchanged:", path.relative_to(ROOT), text.count("\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
