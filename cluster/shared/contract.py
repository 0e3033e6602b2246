"""The cache contract: what a router and a replica must agree on for the
router's block hashes to name the replica's cached blocks.

A replica registers its contract with the prefix directory; the directory's
``LOOKUP`` compares it with the router's and answers ``-1`` instead of a hit
count for a replica that differs, and the router refuses that replica (a
clear log line naming the fields that differ and the
``prefixserve:router_refused_replicas`` gauge) instead of silently seeing
zero hits. Four fields:

    hash        the block-hash scheme (``cluster.shared.hashing.HASH_SCHEME``)
    block_size  tokens per KV block
    model       the model fingerprint (``cluster.shared.fingerprint``)
    tokenizer   sha256 of the tokenizer file, or ``none`` without one (the
                router tokenizes prompts: a replica with another tokenizer
                would read other tokens)

Encoded as ``hash=prefixserve/v1;block_size=16;model=<hex>;tokenizer=<hex>``;
an empty string means "not declared" and is never compared.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from cluster.shared.hashing import HASH_SCHEME

FIELDS = ("hash", "block_size", "model", "tokenizer")
NO_TOKENIZER = "none"


@dataclass(frozen=True)
class CacheContract:
    """What must match between a router and a replica (see module doc)."""

    block_size: int
    model: str
    tokenizer: str = NO_TOKENIZER
    hash: str = HASH_SCHEME

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        for name in ("model", "tokenizer", "hash"):
            value = getattr(self, name)
            if not value or any(c in value for c in ";=\n"):
                raise ValueError(f"contract field {name} must be non-empty without ';', '=' or newlines, "
                                 f"got {value!r}")

    def encode(self) -> str:
        """The one-line form stored in the directory."""
        return ";".join(f"{name}={value}" for name, value in self._items())

    @classmethod
    def decode(cls, text: str) -> "CacheContract":
        """Parses ``encode()``'s output.

        Raises:
            ValueError: A field is missing, unknown or malformed.
        """
        fields = {}
        for part in text.split(";"):
            name, sep, value = part.partition("=")
            if not sep or name not in FIELDS or name in fields:
                raise ValueError(f"malformed cache contract {text!r}: expected {';'.join(f + '=…' for f in FIELDS)}")
            fields[name] = value
        missing = [f for f in FIELDS if f not in fields]
        if missing:
            raise ValueError(f"cache contract {text!r} lacks {', '.join(missing)}")
        if not fields["block_size"].isdigit():
            raise ValueError(f"cache contract {text!r}: block_size must be an integer")
        return cls(int(fields["block_size"]), fields["model"], fields["tokenizer"], fields["hash"])

    def differences(self, other: Union["CacheContract", str]) -> list[str]:
        """``"field: ours != theirs"`` for each field that differs from ``other``
        (an encoded contract that does not parse differs as a whole)."""
        if isinstance(other, str):
            try:
                other = CacheContract.decode(other)
            except ValueError as exc:
                return [str(exc)]
        return [f"{name}: {mine} != {theirs}" for (name, mine), (_, theirs) in zip(self._items(), other._items())
                if mine != theirs]

    def _items(self) -> list[tuple[str, str]]:
        return [("hash", self.hash), ("block_size", str(self.block_size)), ("model", self.model),
                ("tokenizer", self.tokenizer)]


def tokenizer_fingerprint(path: Union[str, os.PathLike, None]) -> str:
    """sha256 of a ``tokenizer.json`` (a folder means its ``tokenizer.json``),
    or ``NO_TOKENIZER`` when there is none."""
    if path is None:
        return NO_TOKENIZER
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        return NO_TOKENIZER
    return hashlib.sha256(path.read_bytes()).hexdigest()


def contract_for(block_size: int, model_fingerprint: str, tokenizer_path: Optional[Union[str, os.PathLike]]) -> str:
    """The encoded contract of a model folder served with ``block_size``."""
    return CacheContract(block_size, model_fingerprint, tokenizer_fingerprint(tokenizer_path)).encode()
