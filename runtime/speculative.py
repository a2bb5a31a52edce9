"""Speculative decoding: drafters, and the rules for who speculates, verified in the continuous batch.

Two drafters share one interface (``Drafter``): prompt lookup, here, and a draft model
(``runtime.draft_model``). With prompt lookup, a decoding request whose last tokens also occur earlier in its
prompt or output proposes what followed them there (the longest recent n-gram match, ``NgramDrafter``) as up to
K draft tokens. The scheduler gives the
request a chunk of its last token plus the drafts, computed in the same forward pass as the other rows' decodes
and prefills; the sampler verifies them (``Sampler.verify``): greedy rows keep the drafts that equal the argmax
at each position, sampled rows accept each draft with the probability the target gives it and on a rejection
draw from the target with that token removed (rejection sampling with a one-token proposal, which leaves the
target distribution unchanged). Either way one more token, from the target, follows the accepted drafts, so a
step always yields at least the token plain decoding would.

Invariants: drafts live in ``Req.draft_ids`` until verified, never in ``output_ids``; the KV slots of rejected
drafts go back to the pool before the radix tree sees the request again, so the tree only ever holds accepted
tokens; a request speculates only where verification is exact: no logprobs, no penalties or logit bias,
``min_new_tokens`` reached. A constrained request's drafts are cut where they leave its grammar
(``runtime.grammar.grammar_cut``) and each verification row is masked by the grammar state after the drafts
before it (``draft_mask``), so the target distribution verified is the constrained one; the tokens the grammar
forces are appended by jump-forward before any drafting, as without speculation.

Adaptive: per request, the draft length follows its acceptance (halved after a step that accepted nothing,
doubled back after one that accepted all), and a request whose drafts keep failing pauses for a while; per
batch, greedy rows stop speculating when more than ``max_batch`` rows decode, where a decode step is no longer
bound by reading the weights (sampled rows keep their own rule only, so a seed's draws do not depend on the batch).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from radixserve.runtime.request import Req

# A request whose last PAUSE_AFTER speculation steps accepted nothing stops proposing for PAUSE_STEPS steps.
PAUSE_AFTER = 3
PAUSE_STEPS = 16


@dataclass
class SpecState:
    """One request's adaptive draft length (the same rule for every drafter)."""

    k: int
    misses: int = 0  # consecutive speculation steps that accepted nothing
    paused: int = 0  # steps left without proposing


@dataclass
class NgramState(SpecState):
    """The n-gram drafter's state: also the index over the request's tokens."""

    index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> where its latest successor sits
    indexed: int = 0  # tokens [0, indexed) are in the index


class Drafter(ABC):
    """What the engine core asks of a drafter: ``propose_batch`` drafts for every request that may speculate
    after a step, in one call (a draft model batches its forward passes over them); ``record`` adapts a request's
    draft length to how its drafts fared; ``release`` drops whatever the drafter holds for a finished request."""

    def __init__(self, max_draft: int) -> None:
        if max_draft < 1:
            raise ValueError("need max_draft >= 1")
        self.max_draft = max_draft

    def state(self, req: Req) -> SpecState:
        if req.spec is None:
            req.spec = SpecState(k=self.max_draft)
        return req.spec

    def budget(self, req: Req, limit: int) -> int:
        """How many tokens the request may draft now: its draft length within ``limit``; 0 while paused."""
        state = self.state(req)
        if state.paused:
            state.paused -= 1
            return 0
        return max(0, min(limit, state.k))

    @abstractmethod
    def propose_batch(self, wants: list[tuple[Req, int]]) -> list[list[int]]:
        """Drafts for each ``(request, limit)``: at most ``limit`` tokens each (empty: nothing to propose)."""

    def record(self, req: Req, proposed: int, accepted: int) -> None:
        """Adapt the request's draft length to how its last drafts fared."""
        state = self.state(req)
        if accepted == 0:
            state.misses += 1
            state.k = max(1, state.k // 2)
            if state.misses >= PAUSE_AFTER:
                state.paused, state.misses = PAUSE_STEPS, 0
        else:
            state.misses = 0
            if accepted == proposed:
                state.k = min(self.max_draft, state.k * 2)

    @abstractmethod
    def release(self, req: Req) -> None:
        """The request finished (or was aborted): free what the drafter keeps for it."""

    @abstractmethod
    def info(self) -> dict[str, int | str]:
        """What ``server_info`` shows of the drafter."""


class NgramDrafter(Drafter):
    """Prompt lookup: find the longest n-gram (``max_n`` down to ``min_n`` tokens) that ends the sequence and
    occurred before; propose the tokens that followed its latest earlier occurrence. O(new tokens) per step: the
    index of n-gram -> successor position grows as tokens are appended."""

    def __init__(self, max_draft: int, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        super().__init__(max_draft)
        self.min_n, self.max_n = min_n, max_n

    def state(self, req: Req) -> NgramState:
        if req.spec is None:
            req.spec = NgramState(k=self.max_draft)
        return req.spec

    def _index(self, state: NgramState, tokens: list[int]) -> None:
        # Token at position p is the successor of the n-grams that end at p - 1.
        for p in range(max(state.indexed, 1), len(tokens)):
            for n in range(self.min_n, self.max_n + 1):
                if p - n >= 0:
                    state.index[tuple(tokens[p - n : p])] = p
        state.indexed = len(tokens)

    def propose_batch(self, wants: list[tuple[Req, int]]) -> list[list[int]]:
        return [self.propose(req, limit) for req, limit in wants]

    def info(self) -> dict[str, int | str]:
        return {"algorithm": "ngram", "max_draft_tokens": self.max_draft}

    def release(self, req: Req) -> None:
        return None  # the n-gram index lives on the request itself (``Req.spec``) and goes with it

    def propose(self, req: Req, limit: int) -> list[int]:
        """Up to ``min(limit, the request's draft length)`` draft tokens (empty: nothing matched, or paused)."""
        k = self.budget(req, limit)
        if k <= 0:
            return []
        state = self.state(req)
        tokens = req.all_ids
        self._index(state, tokens)
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) <= n:
                continue
            start = state.index.get(tuple(tokens[-n:]))
            if start is not None and start < len(tokens):
                # A match close to the end means a repeating stretch: what followed it repeats with its period.
                period = tokens[start:]
                return (period * -(-k // len(period)))[:k]
        return []


def can_speculate(req: Req) -> bool:
    """Whether verification of this request's drafts is exact (see the module docstring)."""
    p = req.params
    return not p.return_logprob and not p.edits_logits and len(req.output_ids) >= p.min_new_tokens
