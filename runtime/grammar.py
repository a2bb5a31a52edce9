"""The engine's side of constrained decoding: one grammar compiler per model, and the per-step mask.

The compiler (``constrained.GrammarCompiler``) runs on its own worker threads; the engine thread only ever polls
finished futures, so a slow or failing compile never blocks a step.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from radixserve.constrained import (
    CompiledGrammar,
    ConstraintSpec,
    GrammarCompiler,
    TokenizerInfo,
    allocate_bitmask,
    bitmask_to_bool,
    fill_bitmasks,
)
from radixserve.constrained.backend import Matcher
from radixserve.runtime.batch import Failure
from radixserve.runtime.request import ErrorCode, Req


class GrammarViolation(RuntimeError):
    """A token could not be appended to a request's grammar: a backend limit was hit, or (a bug) the token was
    never allowed. Fails that request alone."""

    code = ErrorCode.GRAMMAR


def grammar_failure(req: Req, num_tokens: int | None = None) -> Failure:
    """The failure of a request whose matcher reports an error (``Matcher.error()``), after ``num_tokens`` output
    tokens (default: all of them)."""
    why = req.grammar.error() if req.grammar is not None else None
    n = len(req.output_ids) if num_tokens is None else num_tokens
    return Failure(f"the constraint cannot be followed after {n} output tokens: {why}", ErrorCode.GRAMMAR)


class GrammarSupport:
    """Builds the tokenizer's grammar vocabulary and the compiler on first use (most deployments never pay)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        workers: int,
        timeout_s: float,
        nice: int = 0,
    ):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._workers = workers
        self._timeout_s = timeout_s
        self._nice = nice
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = TokenizerInfo.from_hf(self._tokenizer, vocab_size=self._vocab_size, eos_token_ids=self._eos)
                self._compiler = GrammarCompiler(
                    info, max_workers=self._workers, timeout_s=self._timeout_s, nice=self._nice
                )
            return self._compiler

    def compile(self, spec: ConstraintSpec) -> Future[CompiledGrammar]:
        """A future compiled grammar; fails with ``constrained.GrammarError`` (a ``ValueError``)."""
        return self.compiler.submit(spec)

    def info(self) -> dict[str, Any]:
        with self._lock:
            return self._compiler.info() if self._compiler is not None else {}

    def close(self) -> None:
        with self._lock:
            if self._compiler is not None:
                self._compiler.close()


def grammar_mask(reqs: Sequence[Req], vocab: int, device: torch.device) -> torch.Tensor | None:
    """``[len(reqs), vocab]`` bool mask of allowed next tokens, or ``None`` when no request is constrained.

    Rows of unconstrained requests allow everything; constrained rows are filled in one batched call: on
    llguidance's thread pool when the model runs on an accelerator (the CPU cores are free meanwhile), on the engine
    thread when it runs on the CPU, whose cores the forward pass keeps busy (16 rows: 1.0 ms per step on the engine
    thread, 1.7-2.1 ms on the pool, whose threads then also compete with the next step's OpenMP workers).
    """
    rows = [(req.grammar, i) for i, req in enumerate(reqs) if req.grammar is not None]
    if not rows:
        return None
    bitmask = allocate_bitmask(len(reqs), vocab)
    fill_bitmasks(rows, bitmask, parallel=torch.device(device).type != "cpu")
    return bitmask_to_bool(bitmask, vocab, device)


def grammar_cut(grammar: Matcher, draft: Sequence[int]) -> list[int]:
    """The longest prefix of ``draft`` the grammar takes from its current state (``runtime.speculative``: a draft
    that leaves the grammar is cut there). The grammar is left as it was found; nothing is drafted past its end."""
    before = grammar.num_tokens
    kept = 0
    try:
        for token in draft:
            if grammar.is_terminated() or not grammar.accept_token(token):
                break
            kept += 1
    finally:
        grammar.rollback(grammar.num_tokens - before)
    return list(draft[:kept])


def draft_mask(grammar: Matcher, draft: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor | None:
    """``[len(draft) + 1, vocab]`` bool mask: row ``i`` the tokens the grammar allows after ``draft[:i]`` (the
    verification rows of a speculating request, ``Sampler.verify``), or None when the grammar fails on the way (a
    backend limit: ``grammar.error()`` says which; the drafts were cut to the grammar when proposed, with
    ``grammar_cut``, and it has not moved since). The grammar is left as it was found."""
    bitmask = allocate_bitmask(len(draft) + 1, vocab)
    before = grammar.num_tokens
    try:
        for i, token in enumerate(draft):
            fill_bitmasks([(grammar, i)], bitmask, parallel=False)
            if grammar.error() is not None or not grammar.accept_token(token):
                return None
        fill_bitmasks([(grammar, len(draft))], bitmask, parallel=False)
        if grammar.error() is not None:
            return None
    finally:
        grammar.rollback(grammar.num_tokens - before)
    return bitmask_to_bool(bitmask, vocab, device)
