"""Tokenization of long prompts from cached segments, exactly.

Tokenizing a ~750-token prompt costs the router ~1.4 ms of CPU, most of it
in the pre-tokenizer's regular expression, and services send the same long
system prompts, documents and conversation histories again and again. This
cache cuts a prompt into segments at points where the tokenizer's output is
provably the concatenation of the segments' own tokenizations, and keeps the
ids of recent segments, so a repeated prefix costs a dictionary lookup.

**Why the cut is exact.** The cache is used only for byte-level BPE with
the GPT-2 pre-tokenizer (``ByteLevel(use_regex=True, add_prefix_space=False)``,
no normalizer, no BPE dropout; SmolLM, GPT-2 and StarCoder tokenizers), and
only when no added token contains a space or strips its neighbours
(``lstrip``/``rstrip``). The cuts are at a space ``text[i] == " "`` between
two ASCII letters. Then:

- no added (special) token can span the cut, because none contains a space,
  so added tokens are split out of each segment as out of the whole text;
- the GPT-2 pattern ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+|
  ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`` matches every character, and the
  piece covering the letter before the cut ends at that letter (a
  contraction ends at a letter; `` ?\\p{L}+`` stops at the space); the
  next piece starts at the space, and since the pattern looks only forward,
  the pieces from there on are those of the suffix tokenized alone;
- BPE merges never cross pieces.

So ``encode(a + b) == encode(a) + encode(b)`` for every cut, which
``tests/unit/test_token_cache.py`` also checks on random and adversarial
text against the plain tokenizer. Cut positions depend only on the text
before them (the first valid space at or after ``segment_chars`` from the
previous cut), so prompts that share a prefix share its segments.

Other tokenizers (SentencePiece ``Metaspace``, custom ``Split`` patterns,
normalizers) are tokenized whole, as before: ``SegmentTokenCache.for_tokenizer``
returns None for them.
"""

from __future__ import annotations

import json
import logging
import threading
from array import array
from collections import OrderedDict
from typing import Any, Optional

logger = logging.getLogger(__name__)

DEFAULT_SEGMENT_CHARS = 256
DEFAULT_MAX_SEGMENTS = 16384  # ~700 bytes each (text, ids as uint32): ~12 MB at most
MIN_CACHED_CHARS = 512  # shorter prompts are tokenized whole: the regex is cheap there

_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _why_not_segmentable(tokenizer: Any) -> Optional[str]:
    """None when cutting at spaces between letters is exact for ``tokenizer``, else why not."""
    spec = json.loads(tokenizer.to_str())
    if spec.get("normalizer") is not None:
        return "it has a normalizer"
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True) or pre.get("add_prefix_space", False):
        return f"its pre-tokenizer is {pre.get('type')}, not ByteLevel(use_regex=True, add_prefix_space=False)"
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") not in (None, 0, 0.0):
        return "its model is not BPE without dropout"
    for added in spec.get("added_tokens") or []:
        if " " in added.get("content", "") or added.get("lstrip") or added.get("rstrip"):
            return f"its added token {added.get('content')!r} contains a space or strips its neighbours"
    return None


class SegmentTokenCache:
    """Token ids of long texts, from cached segments (see the module docstring).

    Args:
        tokenizer: A ``tokenizers.Tokenizer`` for which the cut is exact
            (use :meth:`for_tokenizer`, which checks).
        segment_chars: Least characters of a segment (cuts are at the first
            valid space from there).
        max_segments: Segments kept, least recently used dropped first.
    """

    def __init__(self, tokenizer: Any, segment_chars: int = DEFAULT_SEGMENT_CHARS,
                 max_segments: int = DEFAULT_MAX_SEGMENTS) -> None:
        if segment_chars < 1 or max_segments < 1:
            raise ValueError("segment_chars and max_segments must be >= 1")
        self.tokenizer = tokenizer
        self.segment_chars = segment_chars
        self.max_segments = max_segments
        self._segments: OrderedDict[str, array] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self._special_prefix, self._special_suffix = self._specials()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, **kwargs: Any) -> Optional["SegmentTokenCache"]:
        """A cache for ``tokenizer``, or None (logged) when cutting it would not be exact."""
        reason = _why_not_segmentable(tokenizer)
        if reason is not None:
            logger.info("prompts are tokenized whole, without the segment cache: %s", reason)
            return None
        return cls(tokenizer, **kwargs)

    def _specials(self) -> tuple[list[int], list[int]]:
        """The ids the post-processor puts before and after a text (BOS / EOS), from two probes."""
        splits = []
        for probe in ("hello world", "a b c"):
            plain = self.tokenizer.encode(probe, add_special_tokens=False).ids
            full = self.tokenizer.encode(probe, add_special_tokens=True).ids
            starts = [k for k in range(len(full) - len(plain) + 1) if full[k:k + len(plain)] == plain]
            if not starts:
                raise ValueError("the tokenizer's post-processor changes the text's own ids: "
                                 "cannot cache its segments")
            splits.append((full[:starts[0]], full[starts[0] + len(plain):]))
        if splits[0] != splits[1]:
            raise ValueError("the tokenizer's post-processor adds different ids to different texts: "
                             "cannot cache its segments")
        return splits[0]

    def cuts(self, text: str) -> list[int]:
        """Positions where ``text`` is cut: spaces between two ASCII letters, ``segment_chars`` apart at least."""
        out = []
        pos = self.segment_chars
        end = len(text) - 1
        while pos < end:
            i = text.find(" ", pos, end)
            if i < 0:
                break
            if text[i - 1] in _LETTERS and text[i + 1] in _LETTERS:
                out.append(i)
                pos = i + self.segment_chars
            else:
                pos = i + 1
        return out

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids ``tokenizer.encode(text, add_special_tokens).ids`` gives, from cached segments where possible."""
        ids = list(self._special_prefix) if add_special_tokens else []
        start = 0
        for cut in [*self.cuts(text), len(text)]:
            ids += self._segment(text[start:cut])
            start = cut
        if add_special_tokens:
            ids += self._special_suffix
        return ids

    def _segment(self, segment: str) -> array:
        with self._lock:  # front ends tokenize big requests on worker threads too
            cached = self._segments.get(segment)
            if cached is not None:
                self._segments.move_to_end(segment)
                self.hits += 1
                return cached
            self.misses += 1
        ids = array("I", self.tokenizer.encode(segment, add_special_tokens=False).ids)
        with self._lock:
            self._segments[segment] = ids
            if len(self._segments) > self.max_segments:
                self._segments.popitem(last=False)
        return ids
