"""Tokenizing from cached segments gives exactly the plain tokenizer's ids (router/token_cache.py)."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from router.token_cache import MIN_CACHED_CHARS, SegmentTokenCache
from router.tokenizer import RouterTokenizer
from workers.model import loader

# Pieces that stress the pre-tokenizer's pattern around cuts: contractions, runs of
# spaces and newlines, digits, punctuation, non-ASCII letters and the model's added tokens.
PIECES = ["a", "b", "Z", "the", "word", " ", "  ", "\n", "\n\n", "\t", "'s", "'ll", "'", "1", "42", "3.14", ".",
          ",", "!?", "-", "é", "Über", "日本語", "ß", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "user", "\u00a0"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(loader.resolve_model(None) / "tokenizer.json"))


def plain(tokenizer: Tokenizer, text: str, special: bool) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=special).ids


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.sampled_from(PIECES), max_size=120), segment_chars=st.integers(1, 12),
       special=st.booleans())
def test_segments_give_the_plain_tokenizers_ids(tokenizer, parts, segment_chars, special):
    text = "".join(parts)
    cache = SegmentTokenCache(tokenizer, segment_chars=segment_chars, max_segments=64)
    assert cache.encode(text, special) == plain(tokenizer, text, special)
    assert cache.encode(text, special) == plain(tokenizer, text, special)  # again, from the cache


def test_real_text_with_many_cuts(tokenizer):
    import pydoc_data.topics

    text = "".join(pydoc_data.topics.topics.values())
    rng = random.Random(0)
    cache = SegmentTokenCache(tokenizer, segment_chars=16)
    for _ in range(100):
        start = rng.randrange(len(text) - 4000)
        piece = text[start:start + rng.randrange(1, 4000)]
        assert len(cache.cuts(piece)) >= len(piece) // 200
        assert cache.encode(piece) == plain(tokenizer, piece, True)


def test_prompts_sharing_a_prefix_share_its_segments(tokenizer):
    system = " ".join(["You are a careful assistant of the support desk"] * 30)
    cache = SegmentTokenCache(tokenizer, segment_chars=64)
    cache.encode(system + " First question: where is my parcel?")
    misses = cache.misses
    ids = cache.encode(system + " Another question: can I change the address?")
    assert ids == plain(tokenizer, system + " Another question: can I change the address?", True)
    assert cache.misses - misses <= 2  # only the segments after the shared prefix are tokenized
    assert cache.hits >= len(cache.cuts(system)) - 1


def test_the_cache_keeps_at_most_max_segments(tokenizer):
    cache = SegmentTokenCache(tokenizer, segment_chars=4, max_segments=5)
    text = " ".join(f"w{i} alpha beta" for i in range(50))
    assert cache.encode(text) == plain(tokenizer, text, True)
    assert len(cache._segments) == 5


def test_cuts_are_only_at_spaces_between_letters(tokenizer):
    cache = SegmentTokenCache(tokenizer, segment_chars=1)
    text = "ab c1 d. e  f g'\nh i"
    assert [text[i - 1:i + 2] for i in cache.cuts(text)] == ["b c", "f g", "h i"]


def test_router_tokenizer_uses_it_for_long_prompts_only():
    tok = RouterTokenizer.from_model_dir(loader.resolve_model(None))
    assert tok.segment_cache is not None
    long_prompt = "alpha beta " * (MIN_CACHED_CHARS // 5)
    assert tok.encode(long_prompt) == plain(tok.tokenizer, long_prompt, True)
    assert tok.segment_cache.misses > 0
    misses = tok.segment_cache.misses
    assert tok.encode("a short prompt") == plain(tok.tokenizer, "a short prompt", True)
    assert tok.segment_cache.misses == misses
    off = RouterTokenizer(tok.tokenizer, None, "fp", segment_cache=False)
    assert off.segment_cache is None and off.encode(long_prompt) == tok.encode(long_prompt)


def _bpe(pre_tokenizer=None, normalizer=None, added=()) -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, " ": 2, "Ġ": 3}, merges=[]))
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tok.normalizer = normalizer
    for token in added:
        tok.add_tokens([token])
    return tok


@pytest.mark.parametrize("make, why", [
    (lambda: _bpe(pre_tokenizers.Metaspace()), "pre-tokenizer is Metaspace"),
    (lambda: _bpe(pre_tokenizers.ByteLevel(add_prefix_space=True)), "pre-tokenizer is ByteLevel"),
    (lambda: _bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), normalizers.NFC()), "normalizer"),
    (lambda: _bpe(pre_tokenizers.Whitespace()), "pre-tokenizer is Whitespace"),
])
def test_tokenizers_where_a_cut_is_not_proven_exact_are_tokenized_whole(make, why, caplog):
    tok = make()
    with caplog.at_level("INFO", logger="router.token_cache"):
        assert SegmentTokenCache.for_tokenizer(tok) is None
    assert why in caplog.text


def test_an_added_token_with_a_space_turns_the_cache_off(tokenizer):
    from tokenizers import AddedToken

    tok = Tokenizer.from_str(tokenizer.to_str())
    assert SegmentTokenCache.for_tokenizer(tok) is not None
    tok.add_tokens([AddedToken("two words", special=False)])
    assert SegmentTokenCache.for_tokenizer(tok) is None
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"][1]["rstrip"] = True
    assert SegmentTokenCache.for_tokenizer(Tokenizer.from_str(json.dumps(spec))) is None


def test_threads_share_one_cache(tokenizer):
    from concurrent.futures import ThreadPoolExecutor

    cache = SegmentTokenCache(tokenizer, segment_chars=8, max_segments=6)  # constant eviction
    texts = [" ".join(f"tenant{t} asks about item{i % 7} again" for i in range(30)) for t in range(4)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(cache.encode, texts * 25))
    assert results == [plain(tokenizer, t, True) for t in texts * 25]
    assert len(cache._segments) <= 6
