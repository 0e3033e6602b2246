"""Structured outputs' grammar backend (xgrammar): compiles constraints off
the engine thread and tracks each constrained sequence's grammar state for
the engine (``workers/engine/structured.py`` has the protocols)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence

from cluster.shared.config import StructuredOutputsConfig

logger = logging.getLogger(__name__)


def make_backend(tokenizer_file: Optional[Path], vocab_size: int, eos_token_ids: Sequence[int],
                 config: StructuredOutputsConfig):
    """The backend for this model, or None where it cannot run (no
    tokenizer.json, or xgrammar not installed): constrained requests are then
    refused with a message saying why."""
    if tokenizer_file is None or not Path(tokenizer_file).is_file():
        return None
    try:
        import xgrammar  # noqa: F401 - only whether it is installed
    except ImportError:
        logger.warning("xgrammar is not installed: requests with structured outputs will be refused")
        return None
    from workers.structured.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(Path(tokenizer_file), vocab_size, eos_token_ids, config)
