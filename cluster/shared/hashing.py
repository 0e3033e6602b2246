"""The block-hash chain shared by the router and the engine.

Contract (DESIGN.md): only full blocks of ``block_size`` tokens are hashed.

    h_0 = sha256(b"prefixserve/v1" | model_fingerprint | cache_salt)
    h_i = sha256(h_{i-1} | token ids of block i as little-endian uint32)

Digests are truncated to 16 bytes. The chain never uses Python's ``hash()``,
so every process, host and version computes the same values.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

DIGEST_BYTES = 16
HASH_SCHEME = "prefixserve/v1"  # bump when the chain changes: routers and replicas then refuse each other
_DOMAIN = HASH_SCHEME.encode()


def root_hash(model_fingerprint: str, cache_salt: str = "") -> bytes:
    """Returns ``h_0`` for a model and a tenant's cache salt."""
    data = _DOMAIN + model_fingerprint.encode("utf-8") + cache_salt.encode("utf-8")
    return hashlib.sha256(data).digest()[:DIGEST_BYTES]


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Returns the hash of one full block chained onto ``parent``."""
    payload = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return hashlib.sha256(parent + payload).digest()[:DIGEST_BYTES]


def lora_fingerprint(model_fingerprint: str, content_hash: str) -> str:
    """The fingerprint a LoRA adapter's requests hash with: the model's and the
    adapter's content (``workers/lora/adapter.py``), never its name."""
    return f"{model_fingerprint}/lora:{content_hash}"


def hash_block_chain(
    token_ids: Sequence[int],
    block_size: int,
    root: bytes,
    start_block: int = 0,
    parent: bytes | None = None,
) -> list[bytes]:
    """Returns the hashes of every full block of ``token_ids``.

    Args:
        token_ids: The whole token sequence (prompt and any output so far).
        block_size: Tokens per block.
        root: ``h_0`` from :func:`root_hash`.
        start_block: First block to hash; blocks before it are assumed hashed
            already, and ``parent`` must then be the hash of block
            ``start_block - 1``. Used to extend a chain incrementally.
        parent: See ``start_block``.

    Returns:
        Hashes of blocks ``start_block .. len(token_ids) // block_size - 1``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    prev = root if start_block == 0 else parent
    if prev is None:
        raise ValueError("parent is required when start_block > 0")
    first, end = start_block * block_size, len(token_ids) // block_size * block_size
    # All blocks' ids packed at once, as hash_block packs one block, then one
    # sha256 per block over a slice: packing block by block cost the router
    # ~1.6x more on every request.
    data = struct.pack(f"<{max(0, end - first)}I", *token_ids[first:end])
    step = 4 * block_size
    sha256 = hashlib.sha256
    hashes = []
    for offset in range(0, len(data), step):
        prev = sha256(prev + data[offset : offset + step]).digest()[:DIGEST_BYTES]
        hashes.append(prev)
    return hashes
