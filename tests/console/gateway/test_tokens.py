"""Incremental detokenization (held-back UTF-8) and stop strings, with the tiny model's byte-level BPE."""

from __future__ import annotations

from typing import Any

import pytest

from console.gateway import tokens

TEXTS = ["plain ascii text", "héllo wörld — ünïcödé", "你好，世界", "emoji 🚀🌍 mixed ß"]


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_add_up_to_the_whole_decoding_and_never_show_half_a_character(tiny_model: Any, text: str) -> None:
    tok = tokens.load(str(tiny_model.path))
    ids = tok.encode(text)
    detok = tokens.Detokenizer(tok)
    pieces = [detok.push(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_a_stream_that_ends_inside_a_character_flushes_what_it_held_back(tiny_model: Any) -> None:
    tok = tokens.load(str(tiny_model.path))
    ids = tok.encode("🚀")
    assert len(ids) > 1  # four UTF-8 bytes, more than one token in a tiny vocabulary
    detok = tokens.Detokenizer(tok)
    assert detok.push(ids[0]) == ""  # half a rocket is held back
    assert detok.flush() == tok.decode(ids[:1])


def test_stop_strings_cut_at_the_first_match_even_across_pieces() -> None:
    stop = tokens.StopMatcher(("END", "\n\n"))
    out = [stop.feed(p) for p in ["abc E", "N", "D tail"]]
    assert "".join(out) == "abc " and stop.stopped
    plain = tokens.StopMatcher(("END",))
    assert plain.feed("an E") == "an " and plain.feed("ND") == "" and plain.stopped
    nothing = tokens.StopMatcher(("END",))
    assert nothing.feed("E") == "" and nothing.feed("x") == "Ex" and not nothing.stopped
    assert nothing.feed("EN") == "" and nothing.flush() == "EN"
