"""Incremental detokenization and stop-string matching for streamed output.

How the engine combines the two, once per step for each request::

    piece = req.detok.add(new_ids)          # stable text only
    start = len(req.output_text)
    req.output_text += piece
    hit = stops.check(req.output_text, start)
    if hit: req.output_text = req.output_text[:hit[0]]; finish with matched_stop = hit[1]
    elif finishing for another reason: req.output_text += req.detok.flush()  (then check once more)
    send req.output_text[req.sent_text_len : len(req.output_text) - stops.hold_back(req.output_text)]

``len(text) - hold_back(text)`` never decreases as text grows, and a stop string found later never starts
inside text already sent: that text was a proper prefix of the stop, hence held.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"
# Tokens of already-emitted text kept in front of the window: enough for tokenizers whose decoding of a token
# depends on its neighbours (a leading space dropped at the start of a text, "##" word pieces, byte fallback).
CONTEXT_TOKENS = 4
# The incomplete tail of a UTF-8 character is at most 3 bytes; each shows up as at most one U+FFFD, so at most
# this many trailing replacement characters can still change when more tokens arrive.
MAX_UNSTABLE_CHARS = 3
# A window that never reaches a clean end (a model emitting only invalid bytes) is cut here, keeping the cost
# per token bounded; its pending replacement characters are then emitted as they are.
MAX_WINDOW_TOKENS = 64


def _unstable_suffix(text: str) -> int:
    """Trailing characters that a later token may still rewrite: a run of U+FFFD, capped."""
    n = 0
    while n < MAX_UNSTABLE_CHARS and n < len(text) and text[-1 - n] == REPLACEMENT:
        n += 1
    return n


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into a stream of text pieces.

    Only a short window of ids (``self._ids[self._start:]``, a few tokens of context plus what is not yet
    settled) is decoded per step, so the cost per token is O(1) amortized whatever the output length.

    Invariants:
      * ``self._emitted`` characters of ``decode(self._ids[self._start:])`` are already returned, and
        appending ids never changes that prefix (the window starts at a settled boundary);
      * a returned piece never ends in a character that more tokens could still complete: trailing U+FFFD is
        held until the next token resolves it (or ``flush``);
      * the concatenation of all pieces and ``flush()`` equals ``tokenizer.decode(generated_ids)`` for
        tokenizers whose decoding is a concatenation (byte-level BPE, byte fallback). For tokenizers that drop
        a leading space at the start of a text (Metaspace), the prompt context keeps the space a continuation
        really has, as a reader of prompt + output sees it.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-CONTEXT_TOKENS:])
        decoded = self._decode(context)
        if _unstable_suffix(decoded):
            # The prompt ends inside a character: the output must decode on its own, not finish that one.
            context, decoded = [], ""
        self._ids: list[int] = context
        self._start = 0
        self._emitted = len(decoded)
        self._text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    @property
    def text(self) -> str:
        """All text returned so far (generated part only)."""
        return self._text

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated ids and return the newly settled text (possibly empty)."""
        if not token_ids:
            return ""
        self._ids.extend(int(t) for t in token_ids)
        window = self._decode(self._ids[self._start :])
        held = _unstable_suffix(window)
        if len(self._ids) - self._start > MAX_WINDOW_TOKENS:
            held = 0
        stable = len(window) - held
        piece = window[self._emitted : stable] if stable > self._emitted else ""
        self._emitted = max(self._emitted, stable)
        self._text += piece
        if held == 0 and len(self._ids) - self._start > 2 * CONTEXT_TOKENS:
            self._slide()
        return piece

    def _slide(self) -> None:
        """Restart the window a few tokens back from a clean end, so the next decodes stay short."""
        self._start = len(self._ids) - CONTEXT_TOKENS
        self._emitted = len(self._decode(self._ids[self._start :]))
        # The ids before the window are never decoded again.
        del self._ids[: self._start]
        self._start = 0

    def flush(self) -> str:
        """Return whatever is still held (an unfinished character at the end of generation), as decoded."""
        window = self._decode(self._ids[self._start :])
        piece = window[self._emitted :] if len(window) > self._emitted else ""
        self._emitted = max(self._emitted, len(window))
        self._text += piece
        return piece


class StopChecker:
    """Finds stop strings in streamed text, and says how much of the tail to hold back from a stream.

    The match reported is the occurrence that *ends* first (ties: the longer one), i.e. the first stop
    string completed as the text grows. That makes the result independent of how the text is split into steps.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self.max_len = max((len(s) for s in self.stops), default=0)

    def check(self, text: str, new_from: int) -> tuple[int, str] | None:
        """``(cut_index, stop)`` of the first-ending occurrence overlapping ``text[new_from:]``, or None."""
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self.stops:
            pos = text.find(stop, max(0, new_from - len(stop) + 1))
            if pos < 0:
                continue
            key = (pos + len(stop), -len(stop), stop)
            if best is None or key < best:
                best = key
        if best is None:
            return None
        end, neg_len, stop = best
        return end + neg_len, stop

    def hold_back(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
