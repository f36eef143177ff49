"""TextStream: the pieces streamed while tokens arrive, joined, are exactly the whole answer's text, cut at the first
stop string; nothing shown is ever taken back; and each step decodes only the new tokens."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdecode.models import load_tokenizer
from specdecode.pipeline import TextStream
from specdecode.sequence import GenerationResult
from specdecode.stopping import StopCondition
from tiny import VOCAB, tiny_tokenizer

STOPS = ("", "\n\n", "é中", "END")


@pytest.fixture(scope="module")
def byte_tokenizer():
    """SmolLM2's byte-level BPE (the built-in model's files): characters split across tokens."""
    return load_tokenizer("smollm2-135m")


def stream_in_chunks(tokenizer, ids, chunks, stop_strings):
    """Feed `ids` as a generation would (accepted drafts of the given sizes), collecting the pieces."""
    result = GenerationResult()
    stream = TextStream(tokenizer, StopCondition(frozenset(), stop_strings, tokenizer), result)
    pieces, at = [], 0
    final = stop_strings and tokenizer.decode(ids, skip_special_tokens=True)
    for size in chunks:
        result.token_ids.extend(ids[at : at + size])
        at += size
        pieces.append(stream.piece())
        if final:
            shown = "".join(pieces)
            assert StopCondition(frozenset(), stop_strings, tokenizer).trim_text(final).startswith(shown)
    result.token_ids.extend(ids[at:])
    result.finish_reason = "length"
    pieces.append(stream.piece())
    return pieces, stream


texts = st.text(alphabet=st.sampled_from(list("ab \n.éü中文😀ENDx")), max_size=60)


@pytest.mark.models
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts, noise=st.lists(st.integers(0, 49151), max_size=6), chunks=st.lists(st.integers(1, 9), max_size=30),
       stop=st.sampled_from(STOPS))
def test_pieces_join_to_the_whole_text_cut_at_the_stop_string(byte_tokenizer, text, noise, chunks, stop):
    # Raw ids (byte pieces that may never complete a character, special tokens) mixed into real text.
    ids = byte_tokenizer.encode(text, add_special_tokens=False)
    ids = ids[: len(ids) // 2] + noise + ids[len(ids) // 2 :]
    stop_strings = (stop,) if stop else ()
    pieces, stream = stream_in_chunks(byte_tokenizer, ids, chunks, stop_strings)
    whole = StopCondition(frozenset(), stop_strings, byte_tokenizer).trim_text(
        byte_tokenizer.decode(ids, skip_special_tokens=True))
    assert "".join(pieces) == whole
    assert stream.text() == whole
    assert stream.piece() == ""  # all of it was shown once finished


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, VOCAB - 1), max_size=40), chunks=st.lists(st.integers(1, 9), max_size=20),
       stop=st.sampled_from(("", "w1", " w2")))
def test_words_joined_by_the_decoder_keep_their_spaces(ids, chunks, stop):
    """A word-level decoder puts a space between tokens, never before the first: a slice decoded without the tokens
    before it would lose the spaces."""
    tokenizer = tiny_tokenizer()
    stop_strings = (stop,) if stop else ()
    pieces, _ = stream_in_chunks(tokenizer, ids, chunks, stop_strings)
    assert "".join(pieces) == StopCondition(frozenset(), stop_strings, tokenizer).trim_text(
        tokenizer.decode(ids, skip_special_tokens=True))


@pytest.mark.models
def test_a_split_character_is_held_until_complete(byte_tokenizer):
    ids = byte_tokenizer.encode("x😀", add_special_tokens=False)
    assert len(ids) >= 3  # the emoji's bytes span tokens in this vocabulary
    pieces, _ = stream_in_chunks(byte_tokenizer, ids, [1] * (len(ids) - 1), ())
    assert pieces[0] == "x" and not any("\ufffd" in p for p in pieces) and "".join(pieces) == "x😀"


@pytest.mark.models
def test_each_step_decodes_only_the_new_tokens(byte_tokenizer):
    """A full re-decode at every step costs O(n) a token, O(n^2) an answer: 1,000 tokens stream for O(n) ids decoded."""
    ids = byte_tokenizer.encode("the quick brown fox jumps over the lazy dog. " * 120, add_special_tokens=False)[:1000]
    decoded = []

    class Counting:
        def decode(self, token_ids, **kwargs):
            decoded.append(len(token_ids))
            return byte_tokenizer.decode(token_ids, **kwargs)

    pieces, _ = stream_in_chunks(Counting(), ids, [1] * len(ids), ())
    assert "".join(pieces) == byte_tokenizer.decode(ids)
    assert sum(decoded) <= 4 * len(ids)
