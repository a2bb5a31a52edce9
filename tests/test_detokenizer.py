"""Tests of incremental detokenization (UTF-8 safety, leading spaces, cost) and stop-string streaming."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from radixserve.runtime.detokenizer import CONTEXT_TOKENS, MAX_WINDOW_TOKENS, IncrementalDetokenizer, StopChecker

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog. ",
    "你好世界！日本語のテキストも少し。한국어 문장도 있어요. ",
    "Emoji: 😀🎉👍🏽 and café, naïve, über, façade, Ελληνικά, русский. ",
    "def main():\n    return {'key': [1, 2, 3]}\n",
]
SAMPLE_TEXTS = [
    "Hello 世界! 😀 café",
    "  leading spaces and\ttabs\nnew lines  ",
    "👍🏽🎉 naïve über 日本語",
    "the lazy dog says 你好 to the quick fox 🦊",
]


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS[:1] * 10, trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "</s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


TOK = byte_level_tokenizer()
VOCAB = len(TOK)


def chunked(ids: list[int], sizes: Sequence[int]) -> list[list[int]]:
    out, i = [], 0
    for size in sizes:
        if i >= len(ids):
            break
        out.append(ids[i : i + size])
        i += size
    if i < len(ids):
        out.append(ids[i:])
    return out


# ---------------------------------------------------------------------------- detokenizer


def test_tokenizer_splits_multibyte_characters() -> None:
    """The fixture must exercise the hard case: some token decodes to a partial UTF-8 character."""
    ids = TOK.encode("🦊 👍🏽")
    assert any("\ufffd" in TOK.decode([i]) for i in ids)


@pytest.mark.parametrize("text", SAMPLE_TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_streams_real_text_exactly_and_never_breaks_a_character(text: str, skip: bool) -> None:
    prompt = TOK.encode("<|im_start|>user\nHi 😀<|endoftext|>")
    ids = TOK.encode(text) + [TOK.eos_token_id]
    detok = IncrementalDetokenizer(TOK, prompt, skip_special_tokens=skip)
    sofar = ""
    for tid in ids:
        sofar += detok.add([tid])
        assert "\ufffd" not in sofar
        assert detok.text == sofar
    assert detok.flush() == ""
    assert sofar == TOK.decode(ids, skip_special_tokens=skip)
    assert sofar.startswith(text)


def test_partial_character_is_held_until_completed() -> None:
    ids = TOK.encode("a🦊")
    parts = [TOK.decode([i]) for i in ids]
    assert "\ufffd" in parts[-1] or "\ufffd" in parts[-2]
    detok = IncrementalDetokenizer(TOK, [])
    pieces = [detok.add([i]) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "a🦊"
    # Generation that stops mid-character: the remainder comes out of flush() exactly as decode() has it.
    detok = IncrementalDetokenizer(TOK, [])
    held = "".join(detok.add([i]) for i in ids[:-1])
    assert held + detok.flush() == TOK.decode(ids[:-1])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.lists(st.integers(0, VOCAB - 1), max_size=6),
    ids=st.lists(st.integers(0, VOCAB - 1), max_size=40),
    sizes=st.lists(st.integers(1, 4), max_size=40),
    skip=st.booleans(),
)
def test_random_ids_concatenate_to_decode(prompt: list[int], ids: list[int], sizes: list[int], skip: bool) -> None:
    """Any ids, fed in any chunking, give pieces that join to decode(ids); every emitted prefix is final."""
    expected = TOK.decode(ids, skip_special_tokens=skip)
    detok = IncrementalDetokenizer(TOK, prompt, skip_special_tokens=skip)
    sofar = ""
    for chunk in chunked(ids, sizes):
        sofar += detok.add(chunk)
        assert expected.startswith(sofar)
    assert sofar + detok.flush() == expected


@settings(max_examples=100, deadline=None)
@given(text=st.text(st.sampled_from("ab 你好😀🎉é\n👍🏽"), max_size=40), sizes=st.lists(st.integers(1, 3)))
def test_encoded_text_roundtrips(text: str, sizes: list[int]) -> None:
    ids = TOK.encode(text)
    detok = IncrementalDetokenizer(TOK, TOK.encode("prompt: "))
    pieces = [detok.add(c) for c in chunked(ids, sizes)]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == text


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call received."""

    def __init__(self, inner: PreTrainedTokenizerFast) -> None:
        self.inner = inner
        self.calls: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.calls.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_cost_per_token_is_constant() -> None:
    ids = TOK.encode(" ".join(SAMPLE_TEXTS * 60))
    assert len(ids) > 2000
    counting = CountingTokenizer(TOK)
    detok = IncrementalDetokenizer(counting, ids[:50])
    text = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert text == TOK.decode(ids)
    assert max(counting.calls) <= 2 * CONTEXT_TOKENS + 4
    assert sum(counting.calls) <= 3 * CONTEXT_TOKENS * len(ids)


def test_endless_invalid_bytes_keep_the_window_bounded() -> None:
    """A model emitting only stray continuation bytes never reaches a clean end; the cost must stay bounded."""
    stray = next(i for i in range(VOCAB) if TOK.decode([i, i]) == "\ufffd\ufffd" and TOK.decode([i]) == "\ufffd")
    ids = [stray] * (4 * MAX_WINDOW_TOKENS)
    counting = CountingTokenizer(TOK)
    detok = IncrementalDetokenizer(counting, [])
    text = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert text == TOK.decode(ids)
    assert max(counting.calls) <= MAX_WINDOW_TOKENS + 1


def test_leading_space_follows_the_prompt() -> None:
    """Metaspace drops the space at the start of a text; a continuation of the prompt must keep it."""
    tok = metaspace_tokenizer()
    ids = tok.encode("Hello world")
    prompt_ids = tok.encode("Hello")
    assert ids[: len(prompt_ids)] == prompt_ids
    gen = ids[len(prompt_ids) :]
    assert tok.decode(gen) == "world"
    detok = IncrementalDetokenizer(tok, prompt_ids)
    assert "".join(detok.add([i]) for i in gen) + detok.flush() == " world"
    # Spaces between generated words come out as they should, token by token.
    more = tok.encode("Hello world the lazy dog")[len(prompt_ids) :]
    detok = IncrementalDetokenizer(tok, prompt_ids)
    assert "".join(detok.add([i]) for i in more) == " world the lazy dog"


def test_prompt_ending_inside_a_character() -> None:
    ids = TOK.encode("x🦊y")
    split = next(k for k in range(1, len(ids)) if TOK.decode(ids[:k]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(TOK, ids[:split])
    out = "".join(detok.add([i]) for i in ids[split:]) + detok.flush()
    assert out == TOK.decode(ids[split:])


# ---------------------------------------------------------------------------- stop strings


def run_stream(
    detok: IncrementalDetokenizer, stops: StopChecker, chunks: Sequence[Sequence[int]]
) -> tuple[str, str, tuple[int, str] | None]:
    """Drive detokenizer + stop checker the way the engine does; returns (final text, streamed text, hit).

    Asserts along the way that the stream never got ahead of the final text.
    """
    text, sent, hit = "", 0, None
    for i, chunk in enumerate(chunks):
        start = len(text)
        text += detok.add(chunk)
        if i == len(chunks) - 1:
            text += detok.flush()
        hit = stops.check(text, start)
        if hit is not None:
            text = text[: hit[0]]
            break
        upto = len(text) - stops.hold_back(text)
        assert upto >= sent
        sent = max(sent, upto)
    streamed_len = sent
    assert len(text) >= streamed_len, "streamed text that the stop string later cut away"
    return text, text[:streamed_len], hit


def first_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """Reference: the stop string completed first while reading ``text`` left to right (longer wins ties)."""
    for end in range(1, len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(stop):
                return end - len(stop), stop
    return None


@pytest.mark.parametrize("stop", ["lazy dog", "fox jumps over", "世界！", "🎉👍", "\n    return"])
def test_stop_string_split_across_tokens(stop: str) -> None:
    text = "".join(CORPUS)
    ids = TOK.encode(text)
    # The stop string really spans several tokens here.
    assert not any(stop in TOK.decode([i]) for i in ids)
    final, streamed, hit = run_stream(IncrementalDetokenizer(TOK, []), StopChecker([stop]), [[i] for i in ids])
    assert hit is not None and hit[1] == stop
    assert final == text[: text.index(stop)]
    assert stop not in final and streamed == final[: len(streamed)]


def test_stop_checker_basics() -> None:
    checker = StopChecker(["bc", "abcd", "xyz"])
    assert checker.check("xabcd", 0) == (2, "bc")  # "bc" completes before "abcd" would
    assert checker.check("abcd", 4) is None  # the occurrence lies wholly in old text
    assert checker.check("aabcd", 3) == (2, "bc")  # overlaps the new part
    assert checker.check("..xyz", 3) == (2, "xyz")
    assert checker.hold_back("hello xy") == 2
    assert checker.hold_back("abc") == 3  # could still become "abcd"
    assert checker.hold_back("xyz") == 0  # a full match is check's business, not a prefix
    assert StopChecker([]).check("anything", 0) is None
    assert StopChecker([]).hold_back("anything") == 0
    assert StopChecker(["aab"]).hold_back("xaaa") == 2


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(st.sampled_from("ab c"), max_size=30),
    stops=st.lists(st.text(st.sampled_from("ab c"), min_size=1, max_size=4), max_size=3),
    sizes=st.lists(st.integers(1, 5), max_size=30),
)
def test_streaming_stops_match_reference(text: str, stops: list[str], sizes: list[int]) -> None:
    """Whatever the chunking, the result is the text before the first completed stop, and nothing past it
    was ever streamed."""
    ids = TOK.encode(text)
    chunks = chunked(ids, sizes) or [[]]
    final, streamed, hit = run_stream(IncrementalDetokenizer(TOK, []), StopChecker(stops), chunks)
    ref = first_stop(text, stops)
    assert hit == ref
    assert final == (text if ref is None else text[: ref[0]])
    assert final.startswith(streamed)
