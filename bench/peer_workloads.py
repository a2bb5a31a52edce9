"""The four workloads of ``bench/peers.py``, as token ids, and the client that runs them against any server.

Every engine gets the same token ids on its OpenAI ``/v1/completions`` route (``prompt`` as a list of ids), greedy,
``ignore_eos``, streamed, so that wall time, output tokens and time to first token mean the same for all.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.common import CORPUS, make_workload

SYSTEM_HEAD = (
    "You are the support assistant of a software company. Answer from the reference material below, quote it "
    "when it helps, and say so when the answer is not in it.\n\nReference material:\n\n"
)
QUESTIONS = (
    "What is the main point of the section about",
    "Summarize in one sentence what the material says about",
    "Which part of the material explains",
    "Give one fact from the material about",
    "What would you ask the author about",
    "Is anything unclear in the part about",
)


@dataclass(frozen=True)
class Workload:
    """``sessions``: each a list of turns; a turn's prompt is the conversation so far plus ``turn`` new ids. A
    one-turn session is a plain request. ``clients`` sessions run at once."""

    name: str
    sessions: tuple[tuple[tuple[int, ...], ...], ...]
    output_len: int
    clients: int


def _text_ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _corpus_ids(tokenizer: Any, rng: random.Random, n: int) -> list[int]:
    order = list(CORPUS)
    rng.shuffle(order)
    ids: list[int] = []
    while len(ids) < n:
        ids += _text_ids(tokenizer, "\n\n".join(order) + "\n\n")
        rng.shuffle(order)
    return ids[:n]


def shared_prompt(tokenizer: Any, n: int = 48, system_tokens: int = 1300, output_len: int = 32) -> Workload:
    rng = random.Random(1)
    system = _text_ids(tokenizer, SYSTEM_HEAD) + _corpus_ids(tokenizer, rng, system_tokens)
    sessions = []
    for i in range(n):
        topic = rng.choice(CORPUS).split()[rng.randrange(5, 15)]
        question = _text_ids(tokenizer, f"\n\nQuestion {i + 1}: {rng.choice(QUESTIONS)} {topic}?\nAnswer:")
        sessions.append((tuple(system + question),))
    return Workload("shared system prompt", tuple(sessions), output_len, clients=16)


def distinct(tokenizer: Any, n: int = 48, prompt_tokens: int = 600, output_len: int = 64) -> Workload:
    reqs = make_workload(tokenizer, n, (prompt_tokens, prompt_tokens), (output_len, output_len), seed=2)
    return Workload("distinct prompts", tuple((tuple(r.prompt_ids),) for r in reqs), output_len, clients=16)


def multi_turn(tokenizer: Any, conversations: int = 8, turns: int = 4, output_len: int = 48) -> Workload:
    rng = random.Random(3)
    sessions = []
    for c in range(conversations):
        first = _text_ids(tokenizer, SYSTEM_HEAD) + _corpus_ids(tokenizer, rng, 400)
        follow = [
            _text_ids(tokenizer, f"\n\nUser: {rng.choice(QUESTIONS)} point {t + 1} of conversation {c}?\nAssistant:")
            for t in range(turns)
        ]
        sessions.append(tuple([tuple(first + follow[0]), *(tuple(f) for f in follow[1:])]))
    return Workload("multi-turn", tuple(sessions), output_len, clients=conversations)


ONE_USER_PROMPTS = (
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Write a long story about a clockmaker whose clocks begin to run backwards.",
    "Write a long story about two rival bakers in a small mountain town.",
    "Write a long story about a cartographer who maps a city that keeps changing.",
    "Write a long story about a retired astronaut who tends an orchard.",
)


def one_user(tokenizer: Any, output_len: int = 128) -> Workload:
    """One client sending its requests one after another, each its own prompt: the decode rate of a single stream,
    the median over the requests (a single 128-token request varied ~15% between rounds on a shared machine)."""
    sessions = tuple((tuple(_text_ids(tokenizer, p)),) for p in ONE_USER_PROMPTS)
    return Workload("one user", sessions, output_len, clients=1)


def sixteen_users(tokenizer: Any, n: int = 16, prompt_tokens: int = 64, output_len: int = 64) -> Workload:
    """16 users decoding at once from short distinct prompts: the decode-bound batch (for models of ~1B and up,
    where the 600-token prompts of ``distinct`` would measure prefill for minutes)."""
    reqs = make_workload(tokenizer, n, (prompt_tokens, prompt_tokens), (output_len, output_len), seed=4)
    return Workload("16 users", tuple((tuple(r.prompt_ids),) for r in reqs), output_len, clients=16)


WORKLOADS = {"shared": shared_prompt, "distinct": distinct, "multiturn": multi_turn, "single": one_user,
             "users16": sixteen_users}  # fmt: skip


@dataclass
class Result:
    wall_s: float = 0.0
    output_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)  # per request: (tokens - 1) / (last - first)
    cached_tokens: int = 0
    prompt_tokens: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    def ttft(self, q: float) -> float:
        if not self.ttft_s:
            return float("nan")
        values = sorted(self.ttft_s)
        return values[min(len(values) - 1, int(q * len(values)))]

    @property
    def decode(self) -> float:
        return statistics.median(self.decode_tok_s) if self.decode_tok_s else float("nan")


async def _complete(
    client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int, result: Result
) -> list[int] | None:
    """One streamed completion; returns the ids of what it generated (re-encoded by the caller otherwise)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = last = None
    pieces: list[str] = []
    n = 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            result.errors.append(f"{resp.status_code}: {(await resp.aread())[:200]!r}")
            return None
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage")
            if usage:
                n = usage.get("completion_tokens", n)
                result.prompt_tokens += usage.get("prompt_tokens", 0)
                details = usage.get("prompt_tokens_details") or {}
                result.cached_tokens += details.get("cached_tokens") or 0
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    now = time.perf_counter()
                    first = first if first is not None else now
                    last = now
                    pieces.append(choice["text"])
    n = n or output_len
    result.output_tokens += n
    if first is not None:
        result.ttft_s.append(first - start)
        if last is not None and last > first and n > 1:
            result.decode_tok_s.append((n - 1) / (last - first))
    return pieces  # type: ignore[return-value]


async def run(base_url: str, model: str, workload: Workload, tokenizer: Any) -> Result:
    result = Result()
    gate = asyncio.Semaphore(workload.clients)
    # A fresh connection per request: servers close idle keep-alive connections on their own schedule
    # (llama-server after 5 s), and a request sent on one of those fails without a response.
    limits = httpx.Limits(max_connections=workload.clients + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=1800, limits=limits) as client:

        async def session(turns: Sequence[tuple[int, ...]]) -> None:
            async with gate:
                history: list[int] = []
                for turn in turns:
                    history += list(turn)
                    pieces = await _complete(client, model, history, workload.output_len, result)
                    if pieces is None:
                        return
                    history += _text_ids(tokenizer, "".join(pieces))  # type: ignore[arg-type]

        start = time.perf_counter()
        await asyncio.gather(*(session(s) for s in workload.sessions))
        result.wall_s = time.perf_counter() - start
    return result
