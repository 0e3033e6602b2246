"""Reading a config section users give as a mapping (a dict, or its JSON on
the command line), strictly: an unknown key is an error naming it."""

from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Any


def read_mapping(mapping: Any, name: str, example: str) -> dict:
    """``mapping`` as a dict (JSON text is parsed).

    Raises:
        ValueError: Not valid JSON or not a mapping; the message shows ``example``.
    """
    if isinstance(mapping, str):
        try:
            mapping = json.loads(mapping)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(mapping, dict):
        raise ValueError(f"{name} must be a mapping such as {example}, got {mapping!r}")
    return mapping


def check_keys(mapping: dict, cls: type, name: str) -> None:
    """Raises ValueError naming the first key of ``mapping`` that is not a field
    of the dataclass ``cls`` (with the closest one, or the known keys)."""
    known = {f.name for f in dataclasses.fields(cls)}
    for key in mapping:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(known))}"
            raise ValueError(f"unknown {name} key {key!r}{hint}")
