"""The three seeded workloads of ``bench/shared_prefix.py``: a shared chat head, multi-turn conversations,
and distinct prompts, built from the built-in corpus with the model's tokenizer."""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.common import CORPUS, make_workload

SHAPE_ARGS = (
    "output_len", "num_requests", "system_tokens", "few_shot", "question_tokens", "conversations", "turns",
    "document_tokens", "follow_up_tokens", "distinct_tokens",
)  # fmt: skip

QUESTION_STEMS = (
    "What is the main point of this passage?",
    "Summarize the following in one sentence:",
    "Which topic does this excerpt belong to?",
    "Explain this part to a beginner:",
    "What would you ask the author about this?",
    "Is anything in this excerpt wrong or unclear?",
    "Rewrite this more simply:",
    "Give one key fact from this text:",
)
FOLLOW_UP_STEMS = (
    "Can you say more about this part:",
    "How does that relate to this sentence:",
    "Why does the document say",
    "Give me a concrete example of",
    "What is the weakest point in",
)
SYSTEM_HEAD = (
    "You are the documentation assistant of a small company. Answer questions about the reference material "
    "below accurately and briefly. Quote the material when it helps, say so when the answer is not in it, "
    "and never invent facts, names or numbers.\n\nReference material:\n\n"
)


# --- workloads ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Session:
    """A conversation: ``turns[0]`` is its first prompt, ``turns[i]`` the tokens sent after answer ``i-1``."""

    turns: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Workload:
    key: str
    name: str
    sessions: tuple[Session, ...]
    output_len: int
    description: str

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


class TextSource:
    """Seeded excerpts of the built-in corpus, cut by token count."""

    def __init__(self, tokenizer: Any, rng: random.Random) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        order = list(CORPUS)
        rng.shuffle(order)
        self.ids = tokenizer.encode("\n\n".join(order * 4), add_special_tokens=False)

    def excerpt(self, n: int) -> str:
        start = self.rng.randrange(len(self.ids) - n)
        return self.tokenizer.decode(self.ids[start : start + n]).strip()

    def question(self, stems: Sequence[str], n: int) -> str:
        """A stem plus a quoted excerpt, about ``n`` tokens in all."""
        stem = self.rng.choice(stems)
        return f'{stem} "{self.excerpt(max(4, n - self.count(stem) - 3))}"'

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def _user_turn_ids(tokenizer: Any, content: str) -> list[int]:
    """What follows an assistant answer in the chat template: close it, then a user message, then the cue."""
    text = f"<|im_end|>\n<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer.encode(text, add_special_tokens=False)


def shared_prefix_workload(tokenizer: Any, args: argparse.Namespace) -> Workload:
    src = TextSource(tokenizer, random.Random(args.seed * 1000 + 1))
    shots: list[dict[str, str]] = []
    for _ in range(args.few_shot):
        shots.append({"role": "user", "content": src.question(QUESTION_STEMS, args.question_tokens)})
        shots.append({"role": "assistant", "content": src.excerpt(40)})
    fixed = len(_chat_ids(tokenizer, [{"role": "system", "content": SYSTEM_HEAD}, *shots], False))
    system = SYSTEM_HEAD + src.excerpt(max(16, args.system_tokens - fixed))
    head = [{"role": "system", "content": system}, *shots]
    shared = _chat_ids(tokenizer, head, False)
    sessions = []
    for _ in range(args.num_requests):
        question = src.question(QUESTION_STEMS, args.question_tokens)
        ids = _chat_ids(tokenizer, [*head, {"role": "user", "content": question}], True)
        if ids[: len(shared)] != shared:  # the template renders messages independently; this must hold
            raise RuntimeError("the chat template does not render the shared head as a token prefix")
        sessions.append(Session((tuple(ids),)))
    mean_q = statistics.mean(len(s.turns[0]) - len(shared) for s in sessions)
    desc = (
        f"{len(sessions)} requests: shared chat head of {len(shared)} tokens (system prompt + {args.few_shot} "
        f"few-shot pairs) + a distinct question (mean {mean_q:.0f} tokens incl. the chat markup)"
    )
    return Workload("1", "shared", tuple(sessions), args.output_len, desc)


def multiturn_workload(tokenizer: Any, args: argparse.Namespace) -> Workload:
    src = TextSource(tokenizer, random.Random(args.seed * 1000 + 2))
    sessions = []
    for _ in range(args.conversations):
        doc = src.excerpt(args.document_tokens)
        first = f"Please read this document and answer my questions.\n\n{doc}\n\n{src.rng.choice(QUESTION_STEMS)}"
        turns = [tuple(_chat_ids(tokenizer, [{"role": "user", "content": first}], True))]
        for _ in range(args.turns - 1):
            turns.append(tuple(_user_turn_ids(tokenizer, src.question(FOLLOW_UP_STEMS, args.follow_up_tokens))))
        sessions.append(Session(tuple(turns)))
    first_len = statistics.mean(len(s.turns[0]) for s in sessions)
    follow = statistics.mean(len(t) for s in sessions for t in s.turns[1:]) if args.turns > 1 else 0
    desc = (
        f"{len(sessions)} conversations x {args.turns} turns: first prompt mean {first_len:.0f} tokens, each "
        f"later turn adds the {args.output_len}-token answer + a user message (mean {follow:.0f} tokens)"
    )
    return Workload("2", "multiturn", tuple(sessions), args.output_len, desc)


def distinct_workload(tokenizer: Any, args: argparse.Namespace) -> Workload:
    lo, hi = round(args.distinct_tokens * 0.9), round(args.distinct_tokens * 1.1)
    reqs = make_workload(tokenizer, args.num_requests, (lo, hi), (args.output_len, args.output_len), args.seed + 3)
    sessions = tuple(Session((tuple(r.prompt_ids),)) for r in reqs)
    desc = f"{len(sessions)} requests with no shared prefix, prompts of {lo}-{hi} tokens"
    return Workload("3", "distinct", sessions, args.output_len, desc)


BUILDERS: dict[str, Callable[[Any, argparse.Namespace], Workload]] = {
    "1": shared_prefix_workload,
    "2": multiturn_workload,
    "3": distinct_workload,
}
