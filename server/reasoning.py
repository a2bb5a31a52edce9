"""Reasoning output (``--reasoning-parser``): a model's think section apart from its answer.

Qwen3 and the DeepSeek-R1 distills write ``<think>...</think>`` before the answer; clients expect the section as
``reasoning_content`` (Chat), a reasoning item (Responses) or a ``thinking`` block (Messages), and the answer
without it. The R1 templates open the section in the prompt (the output starts inside it); Qwen3's model opens it
itself, and its template closes it in the prompt when thinking is turned off.

Invariants:
  * ``ReasoningSplitter`` only ever returns text that is certainly on its side of the split: a tag cut across two
    deltas is held until it is complete, so the streamed parts joined equal the non-streamed ones (``split`` is
    the same splitter fed the whole text);
  * the reasoning text has no tags and no leading whitespace, the content no leading whitespace; trailing
    whitespace of the reasoning is dropped where the section closes;
  * a constrained request's grammar applies only after the section closes (``reasoning_constraint``).
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.constrained import ConstraintSpec
from radixserve.server.constraints import RequestConstraint

Part = tuple[str, str]  # ("reasoning" | "content", text)


@dataclass(frozen=True)
class ReasoningFormat:
    """How one family of models writes its think section."""

    name: str
    open: str = "<think>"
    close: str = "</think>"

    def opened_in(self, prompt: str, prefill: str | None = None) -> bool:
        """Whether the output starts inside a think section: the prompt ends with the open tag (the template
        opened it: DeepSeek-R1's, Qwen3's told to think), or the prefill being continued (``prefill``: the last
        assistant message, under ``continue_final_message``) opened one and did not close it. Nothing else in the
        prompt decides: a user's question, a system prompt or a document may mention the tag."""
        if prefill is not None:
            start = prefill.rfind(self.open)
            return start >= 0 and prefill.find(self.close, start) < 0
        return prompt.rstrip().endswith(self.open)


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "qwen3": ReasoningFormat("qwen3"),
    "deepseek-r1": ReasoningFormat("deepseek-r1"),
}


class ReasoningSplitter:
    """Splits a streamed answer into ``("reasoning", text)`` and ``("content", text)`` parts."""

    def __init__(self, fmt: ReasoningFormat, opened: bool) -> None:
        self.fmt = fmt
        self._state = "think" if opened else "start"
        self._held = ""  # text not yet returned: a possible tag, or leading whitespace
        self.reasoning: str | None = "" if opened else None  # the whole section, once it has one

    def feed(self, delta: str) -> list[Part]:
        self._held += delta
        out: list[Part] = []
        while True:
            before = (self._state, len(self._held))
            out += self._advance()
            if (self._state, len(self._held)) == before:
                return [p for p in out if p[1]]

    def finish(self) -> list[Part]:
        """Whatever is still held: a tag that never completed is text of the side it was on."""
        held, self._held = self._held, ""
        if self._state == "think":
            return self._reason((held if self.reasoning else held.lstrip()).rstrip())
        return [("content", held.lstrip())] if held.strip() else []

    def _advance(self) -> list[Part]:
        if self._state == "start":
            text = self._held.lstrip()
            if self.fmt.open.startswith(text):  # empty, or a partial open tag: wait
                return []
            if text.startswith(self.fmt.open):
                self._state, self._held, self.reasoning = "think", text[len(self.fmt.open) :], ""
                return []
            self._state = "content"
            return []
        if self._state == "think":
            if not self.reasoning:  # the section's leading whitespace goes
                self._held = self._held.lstrip()
            end = self._held.find(self.fmt.close)
            if end >= 0:
                text, self._held = self._held[:end].rstrip(), self._held[end + len(self.fmt.close) :]
                self._state = "content"
                return self._reason(text)
            # Held back: a partial close tag and the whitespace before it (the section's end drops that).
            cut = len(self._held) - _partial_suffix(self._held, self.fmt.close)
            cut = len(self._held[:cut].rstrip())
            text, self._held = self._held[:cut], self._held[cut:]
            return self._reason(text)
        text = self._held.lstrip() if self._state == "content" else self._held
        if not text:
            self._held = ""
            return []
        self._held, self._state = "", "answer"
        return [("content", text)]

    def _reason(self, text: str) -> list[Part]:
        self.reasoning = (self.reasoning or "") + text
        return [("reasoning", text)]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split(fmt: ReasoningFormat, opened: bool, text: str) -> tuple[str | None, str]:
    """``(reasoning or None when the answer had no section, content)`` of a whole answer."""
    splitter = ReasoningSplitter(fmt, opened)
    parts = splitter.feed(text) + splitter.finish()
    return splitter.reasoning, "".join(t for kind, t in parts if kind == "content")


def reasoning_constraint(
    inner: RequestConstraint | None, fmt: ReasoningFormat, opened: bool, max_tokens: int | None
) -> RequestConstraint | None:
    """The request's constraint applied after the think section (and the section capped at ``max_tokens``
    tokens); None when there is neither a constraint nor a cap. Errors keep the inner constraint's fields."""
    if inner is None and max_tokens is None:
        return None
    value = {"inner": inner.spec if inner else None, "open": fmt.open, "close": fmt.close, "opened": opened}
    spec = ConstraintSpec("reasoning", {**value, "max_tokens": max_tokens})
    if inner is None:
        return RequestConstraint(spec, "max_thinking_tokens")
    return RequestConstraint(spec, inner.param, inner.sub_params)
