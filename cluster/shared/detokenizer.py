"""Incremental detokenization and stop-string detection for one request.

Decoding token by token breaks multi-byte characters and SentencePiece's
leading spaces. As vLLM does, we decode a sliding window twice, from
``prefix_offset`` to ``read_offset`` (text already emitted) and from
``prefix_offset`` to the end, and emit the difference once it no longer ends
in U+FFFD (an incomplete UTF-8 sequence)::

    ids:  ... p p p p p | o o o | o o
              ^prefix_offset    ^read_offset
    delta = decode(ids[prefix:]) - decode(ids[prefix:read])

Stop strings: the full output text is searched where a stop string could
newly end; the text is cut before it. While streaming, the last
``len(longest stop) - 1`` characters are held back, so a client never sees
the start of a stop string that is then removed.
"""

from __future__ import annotations

from typing import Protocol, Sequence

# Prompt tokens kept as decoding context (leading spaces, merges).
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class TokenDecoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns appended token ids into text deltas and detects stop strings.

    Args:
        tokenizer: Anything with ``decode(ids, skip_special_tokens)``
            (a ``tokenizers.Tokenizer`` works).
        prompt_token_ids: The prompt; its last tokens give decoding context.
        stop: Stop strings (not included in the output text).
        skip_special_tokens: Drop special tokens from the text.
    """

    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(stop)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # output text so far (cut at a stop string)
        self._num_emitted = 0
        self.stopped = False

    def append(self, new_token_ids: Sequence[int]) -> str:
        """Adds tokens; returns the text that may be streamed now (mutates state).

        After a stop string is found ``stopped`` is True and later calls
        return "".
        """
        if self.stopped:
            return ""
        for token_id in new_token_ids:
            self._ids.append(token_id)
            self.text += self._decode_step()
            if self._stop and self._find_stop():
                break
        end = len(self.text) if self.stopped else max(self._num_emitted, len(self.text) - self._holdback)
        delta = self.text[self._num_emitted : end]
        self._num_emitted = end
        return delta

    def flush(self) -> str:
        """Returns all text not yet emitted (call once, when the request ends)."""
        if not self.stopped:
            tail = self._tok.decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip)
            head = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip)
            if len(tail) > len(head):
                self.text += tail[len(head) :]
                self._read_offset = len(self._ids)
        delta = self.text[self._num_emitted :]
        self._num_emitted = len(self.text)
        return delta

    def _decode_step(self) -> str:
        head = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip)
        full = self._tok.decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip)
        if len(full) > len(head) and not full.endswith(_REPLACEMENT):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(head) :]
        return ""

    def _find_stop(self) -> bool:
        # A stop string can only newly end inside the part not yet searched.
        window_start = max(0, self._num_emitted - self._holdback - 1)
        cut = -1
        for stop in self._stop:
            idx = self.text.find(stop, window_start)
            if idx != -1 and (cut == -1 or idx < cut):
                cut = idx
        if cut == -1:
            return False
        self.text = self.text[:cut]
        self.stopped = True
        return True
