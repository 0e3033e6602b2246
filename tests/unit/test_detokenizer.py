"""Incremental detokenization and stop strings, with the default model's tokenizer
and with a tiny fake decoder for exact edge cases."""

from __future__ import annotations

import pytest

from cluster.shared.detokenizer import IncrementalDetokenizer


class ByteDecoder:
    """Token i is byte i; decoding joins bytes as UTF-8 (U+FFFD for partial)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def stream(detok, ids, step=1):
    text = ""
    for i in range(0, len(ids), step):
        text += detok.append(ids[i : i + step])
    return text + detok.flush()


def test_multibyte_characters_are_emitted_whole():
    ids = list("héllo €!".encode())
    detok = IncrementalDetokenizer(ByteDecoder(), [])
    deltas = [detok.append([t]) for t in ids]
    assert "".join(deltas) + detok.flush() == "héllo €!"
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("step", [1, 2, 5])
def test_stop_string_is_cut_and_never_streamed(step):
    ids = list(b"abc STOP def")
    detok = IncrementalDetokenizer(ByteDecoder(), [], stop=["STOP"])
    text = stream(detok, ids, step)
    assert text == "abc "
    assert detok.stopped


def test_earliest_of_several_stop_strings_wins():
    detok = IncrementalDetokenizer(ByteDecoder(), [], stop=["yz", "x"])
    assert stream(detok, list(b"wxyz")) == "w"


def test_no_stop_streams_everything():
    detok = IncrementalDetokenizer(ByteDecoder(), [], stop=["nope"])
    assert stream(detok, list(b"hello world")) == "hello world"
    assert not detok.stopped
