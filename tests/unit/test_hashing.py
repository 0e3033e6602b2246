"""The block-hash chain: golden values that pin the contract, built from the
spec with hashlib directly, and incremental == whole."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest

from cluster.shared.hashing import DIGEST_BYTES, hash_block, hash_block_chain, root_hash
from tests.unit.engine_fakes import make_request

# Pinned: changing any of these breaks every router / replica pair in a
# rolling upgrade, so a change must be deliberate (bump b"prefixserve/v1").
GOLDEN_ROOT = "3e02dbf35894ab8efdcd17307712e752"  # root_hash("m", "")
GOLDEN_ROOT_SALTED = "c68fa910dacbb6f9a067a9720b5ea29e"  # root_hash("m", "tenant")
GOLDEN_CHAIN = [  # hash_block_chain([1..9], 4, root_hash("m"))
    "8ef6e367a61f8526110a16f56999a191",
    "4588beeb146a179e8a6f940c09f1063e",
]
GOLDEN_EDGE_BLOCK = "973908a7e95e3b52dffb8d710e4ad0fd"  # hash_block(root, [2**32-1, 0, 1, 256])


def spec_sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()[:16]


def test_root_hash_follows_the_spec_and_is_pinned():
    assert root_hash("m") == spec_sha(b"prefixserve/v1" + b"m" + b"")
    assert root_hash("m").hex() == GOLDEN_ROOT
    assert root_hash("m", "tenant") == spec_sha(b"prefixserve/v1mtenant")
    assert root_hash("m", "tenant").hex() == GOLDEN_ROOT_SALTED
    assert len(root_hash("m")) == DIGEST_BYTES == 16


def test_chain_follows_the_spec_and_is_pinned():
    root = root_hash("m")
    chain = hash_block_chain(list(range(1, 10)), 4, root)
    h1 = spec_sha(root + struct.pack("<4I", 1, 2, 3, 4))
    h2 = spec_sha(h1 + struct.pack("<4I", 5, 6, 7, 8))
    assert chain == [h1, h2]  # the partial block (token 9) is never hashed
    assert [h.hex() for h in chain] == GOLDEN_CHAIN


def test_token_ids_are_little_endian_uint32():
    root = root_hash("m")
    block = [2**32 - 1, 0, 1, 256]
    payload = b"\xff\xff\xff\xff" + b"\x00" * 4 + b"\x01\x00\x00\x00" + b"\x00\x01\x00\x00"
    assert hash_block(root, block) == spec_sha(root + payload)
    assert hash_block(root, block).hex() == GOLDEN_EDGE_BLOCK


def test_incremental_chain_equals_whole_chain():
    rng = random.Random(0)
    root = root_hash("fp", "salt")
    tokens = [rng.randrange(50_000) for _ in range(103)]
    whole = hash_block_chain(tokens, 8, root)
    head = hash_block_chain(tokens[:40], 8, root)
    tail = hash_block_chain(tokens, 8, root, start_block=len(head), parent=head[-1])
    assert head + tail == whole
    assert len(whole) == 103 // 8


def test_sequence_extends_the_chain_one_block_at_a_time():
    seq = make_request("a", list(range(7)), block_size=4)
    assert seq.hash_root == root_hash("test-model", "")
    for t in range(100, 120):
        seq.append_token(t)
        assert seq.block_hashes == hash_block_chain(seq.all_token_ids, 4, seq.hash_root)
    assert len(seq.block_hashes) == 27 // 4


def test_salt_and_fingerprint_isolate_chains():
    tokens = list(range(8))
    a = make_request("a", tokens).block_hashes
    b = make_request("b", tokens, cache_salt="tenant-b").block_hashes
    assert a == make_request("c", tokens).block_hashes
    assert set(a).isdisjoint(b)
    assert root_hash("m1") != root_hash("m2")


def test_chain_argument_errors():
    with pytest.raises(ValueError, match="block_size"):
        hash_block_chain([1, 2], 0, root_hash("m"))
    with pytest.raises(ValueError, match="parent"):
        hash_block_chain([1, 2, 3, 4, 5, 6, 7, 8], 4, root_hash("m"), start_block=1)
