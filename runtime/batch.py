"""Typed messages between the scheduler and the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.runtime.request import ErrorCode, Req, TokenLogprob


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute ``req.all_ids[start:end]`` this step; their KV slots are already in ``req.slots[start:end]``.

    A chunk of one token after position 0 is a *decode* (batched attention over the slot table); anything else
    is an *extend* (a prefill chunk, possibly after a cached prefix).
    """

    req: Req
    start: int
    end: int
    sample: bool  # the chunk reaches the end of the sequence: sample the next token from its last position
    # Decodes only: ``(group, length)`` when the first ``length`` slots are a cached prefix that the other decode
    # rows of the same group share (the radix tree's node); attention reads that prefix once per group.
    shared_prefix: tuple[int, int] | None = None
    # Speculative decoding: draft tokens computed after ``all_ids[start:end]`` (their slots follow in
    # ``req.slots``) and verified at every position; such a chunk is an extend, never a decode.
    draft: tuple[int, ...] = ()

    @property
    def is_decode(self) -> bool:
        return self.end - self.start == 1 and self.start > 0 and not self.draft

    @property
    def num_tokens(self) -> int:
        return self.end - self.start + len(self.draft)

    @property
    def tokens(self) -> list[int]:
        return self.req.ids(self.start, self.end) + list(self.draft)


@dataclass(frozen=True)
class BatchPlan:
    """One forward pass. Invariant: decode chunks come first, then extends; no request appears twice."""

    chunks: tuple[ScheduledChunk, ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_decode(self) -> int:
        return sum(1 for c in self.chunks if c.is_decode)

    def split(self) -> tuple[BatchPlan, BatchPlan]:
        """Two plans of half the chunks each, in order (so each keeps the decodes-first invariant)."""
        mid = len(self.chunks) // 2
        return BatchPlan(self.chunks[:mid]), BatchPlan(self.chunks[mid:])


@dataclass(frozen=True)
class Failure:
    """Why one request of a step failed, and whose fault it is."""

    message: str
    code: ErrorCode = ErrorCode.ENGINE


@dataclass
class StepResult:
    """What the model runner produced for a plan, indexed like ``plan.chunks``.

    ``next_tokens[i]`` is ``None`` for chunks that did not sample; ``prompt_logprobs[i]`` holds the log-probs
    of the prompt tokens this chunk scored (empty unless the request asked for them). For a chunk with drafts,
    ``accepted[i]`` are the drafts verification kept; ``next_tokens[i]`` is the token that follows them.
    """

    next_tokens: list[int | None]
    logprobs: list[TokenLogprob | None]
    prompt_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    errors: dict[int, Failure] = field(default_factory=dict)  # chunk index -> why that request failed
    accepted: dict[int, list[int]] = field(default_factory=dict)  # chunk index -> the drafts kept
    # chunk index -> what the chunk adds to its request's embedding (``runtime.pooling.pool_chunk``)
    pooled: dict[int, Any] = field(default_factory=dict)

    @classmethod
    def failed(cls, n: int, failure: Failure) -> StepResult:
        """Every one of ``n`` chunks failed for the same reason."""
        return cls([None] * n, [None] * n, [[] for _ in range(n)], dict.fromkeys(range(n), failure))

    def then(self, other: StepResult) -> StepResult:
        """This result followed by ``other``'s, as for the plan that ``BatchPlan.split`` cut in two."""
        n = len(self.next_tokens)
        return StepResult(
            self.next_tokens + other.next_tokens,
            self.logprobs + other.logprobs,
            self.prompt_logprobs + other.prompt_logprobs,
            {**self.errors, **{n + i: f for i, f in other.errors.items()}},
            {**self.accepted, **{n + i: a for i, a in other.accepted.items()}},
            {**self.pooled, **{n + i: p for i, p in other.pooled.items()}},
        )
