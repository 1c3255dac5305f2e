"""StopMatcher: hold-back of possible stop-string prefixes, hits across chunk boundaries, flush."""

from __future__ import annotations

import random

import pytest

from exl2_backend.tokenizer import StopMatcher


def _run(stops, chunks):
    """(emitted text, hit) after feeding `chunks`; flushes when no stop string was hit."""
    matcher = StopMatcher(stops)
    out = []
    for chunk in chunks:
        emit, hit = matcher.push(chunk)
        out.append(emit)
        if hit:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def test_holds_back_a_possible_prefix():
    m = StopMatcher(["</s>"])
    assert m.push("Hello <") == ("Hello ", False)
    assert m.held == "<"
    assert m.push("/") == ("", False)
    assert m.push("b>") == ("</b>", False)  # it was not the stop string after all
    assert m.held == ""


def test_stop_across_chunk_boundaries():
    m = StopMatcher(["STOP"])
    assert m.push("abc ST") == ("abc ", False)
    assert m.push("O") == ("", False)
    assert m.push("P and more") == ("", True)
    assert m.stopped and m.hit == "STOP"
    assert m.push("later") == ("", True)  # nothing after a hit
    assert m.flush() == ""


def test_text_before_the_stop_in_the_same_chunk_is_emitted():
    assert StopMatcher(["\n\n"]).push("line one\n\nline two") == ("line one", True)
    assert StopMatcher(["x"]).push("x at the start") == ("", True)


def test_multiple_stop_strings_earliest_wins():
    m = StopMatcher(["world", "lo w", "Observation:"])
    assert m.push("hello world") == ("hel", True)
    assert m.hit == "lo w"
    # Same start: the longer stop string is reported.
    m = StopMatcher(["ab", "abc"])
    assert m.push("xabcd") == ("x", True) and m.hit == "abc"


def test_hold_back_uses_the_longest_candidate_prefix():
    m = StopMatcher(["<|end|>", "|x"])
    assert m.push("a<|en") == ("a", False)
    assert m.held == "<|en"
    assert m.push("d") == ("", False)
    assert m.push("|>tail") == ("", True)


def test_overlapping_partial_match_is_not_lost():
    # "ab" is held, then "ab" + "abc" contains the stop string starting at the second "a".
    assert _run(["abc"], ["xab", "abc"]) == ("xab", True)
    assert _run(["aab"], ["a", "a", "a", "b"]) == ("a", True)


def test_flush_releases_held_text():
    m = StopMatcher(["###"])
    assert m.push("total ##") == ("total ", False)
    assert m.flush() == "##"
    assert m.flush() == ""


def test_no_stop_strings_passes_everything_and_empty_strings_are_ignored():
    m = StopMatcher(["", ""])
    assert m.stop_strings == ()
    assert m.push("anything <") == ("anything <", False)
    assert StopMatcher(None).push("x") == ("x", False)


@pytest.mark.parametrize("seed", range(20))
def test_random_chunkings_equal_the_unstreamed_answer(seed):
    rng = random.Random(seed)
    alphabet = "ab<>/ "
    stops = ["</a>", "bb", "<<>"]
    text = "".join(rng.choice(alphabet) for _ in range(60))
    cuts = sorted(rng.sample(range(1, len(text)), 12))
    chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    positions = [p for p in (text.find(s) for s in stops) if p >= 0]
    expected = (text[: min(positions)], True) if positions else (text, False)
    assert _run(stops, chunks) == expected
    assert _run(stops, list(text)) == expected  # one character at a time
