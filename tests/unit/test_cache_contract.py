"""The cache contract routers and replicas compare (cluster/shared/contract.py)."""

from __future__ import annotations

import pytest

from cluster.shared.contract import NO_TOKENIZER, CacheContract, contract_for, tokenizer_fingerprint
from cluster.shared.hashing import HASH_SCHEME


def test_encode_decode_round_trip_and_differences():
    a = CacheContract(16, "abc", "tok")
    assert a.encode() == f"hash={HASH_SCHEME};block_size=16;model=abc;tokenizer=tok"
    assert CacheContract.decode(a.encode()) == a
    b = CacheContract(32, "abc", "other", hash="prefixserve/v2")
    assert a.differences(b) == ["hash: prefixserve/v1 != prefixserve/v2", "block_size: 16 != 32",
                                "tokenizer: tok != other"]
    assert a.differences(a.encode()) == []
    assert a.differences("garbage")[0].startswith("malformed cache contract")


@pytest.mark.parametrize("text", ["", "hash=x;block_size=16;model=m", "hash=x;block_size=a;model=m;tokenizer=t",
                                  "hash=x;block_size=1;model=m;tokenizer=t;extra=1",
                                  "hash=x;hash=y;model=m;tokenizer=t"])
def test_malformed_contracts_are_refused(text):
    with pytest.raises(ValueError):
        CacheContract.decode(text)


def test_fields_cannot_break_the_encoding():
    with pytest.raises(ValueError, match="model"):
        CacheContract(16, "a;b")
    with pytest.raises(ValueError, match="block_size"):
        CacheContract(0, "m")


def test_tokenizer_fingerprint_follows_the_file(tmp_path):
    assert tokenizer_fingerprint(tmp_path) == NO_TOKENIZER
    (tmp_path / "tokenizer.json").write_text('{"a": 1}')
    first = tokenizer_fingerprint(tmp_path)
    assert first == tokenizer_fingerprint(tmp_path / "tokenizer.json") != NO_TOKENIZER
    (tmp_path / "tokenizer.json").write_text('{"a": 2}')
    assert tokenizer_fingerprint(tmp_path) != first
    assert contract_for(16, "m", tmp_path).endswith("tokenizer=" + tokenizer_fingerprint(tmp_path))
