"""Scoring ``select`` choices by the model's log-probabilities, in token space.

For each choice the prompt and ``prompt + choice`` are tokenized by the backend (as the server tokenizes text), and
only the tokens after their longest common token prefix are scored. This is what makes the boundary right when
the tokenizer merges across it: a prompt ending in ``"Answer:"`` and a choice ``" yes"`` score the token
``" yes"``; a prompt ending in ``"Answer: "`` and a choice ``"yes"`` give ``"Answer:" + " yes"`` too, where the
prompt's own last token ``" "`` is replaced, and ``" yes"`` is scored (not ``"yes"`` after a dangling space).

All choices go to the backend in batched requests (``SCORE_BATCH`` each) with one ``start`` (the smallest
boundary), so the shared prompt is computed once (or taken from the prefix cache); each choice then reads its own
span.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.lang.backend.base import Backend

# Choices scored per request to the backend (a server queues at most --max-queued-requests, 1024 by default).
SCORE_BATCH = 256
# What a greedy select counts for "this choice ended here" against another choice's next token: log(1/2).
ENDS_HERE = math.log(0.5)


@dataclass
class SelectResult:
    index: int
    choice: str
    meta: dict[str, Any]


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def choice_spans(prompt_ids: Sequence[int], full_ids: Sequence[Sequence[int]]) -> list[int]:
    """Per choice, the index of its first scored token in its ``prompt + choice`` ids.

    Always ``1 <= start < len(ids)``: at least one token is scored, and the first token of a sequence (which
    nothing predicts) never is.
    """
    starts = []
    for ids in full_ids:
        if len(ids) < 2:
            raise ValueError("select needs a prompt: the first token of a text cannot be scored")
        starts.append(min(max(1, common_prefix_len(prompt_ids, ids)), len(ids) - 1))
    return starts


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def score_choices(backend: Backend, prompt: str, choices: Sequence[str], method: str) -> SelectResult:
    """Rank ``choices`` after ``prompt``; ``meta`` exposes every choice's scores and token log-probabilities."""
    ids = backend.tokenize([prompt, *(prompt + c for c in choices)])
    prompt_ids, full = ids[0], ids[1:]
    starts = choice_spans(prompt_ids, full)
    start = min(starts)
    rows = _prompt_logprobs(backend, full, start, prompt)
    token_lps = [row[s - start :] for row, s in zip(rows, starts)]
    means = [_mean(lps) for lps in token_lps]
    meta: dict[str, Any] = {
        "method": method,
        "choices": list(choices),
        "token_logprobs": token_lps,
        "normalized_logprobs": means,
        "sum_logprobs": [sum(lps) for lps in token_lps],
        "num_tokens": [len(lps) for lps in token_lps],
    }
    if method == "greedy":
        scores = [lps[0] for lps in token_lps]
        # Highest first-token log-probability; choices sharing first tokens are told apart by the next ones. Where
        # one choice ends and another goes on ("yes" / "yes please"), the longer wins only if its next token is
        # likelier than not (a list compare would always prefer it, however unlikely its next token).
        width = max(len(lps) for lps in token_lps)
        padded = [lps + [ENDS_HERE] * (width - len(lps)) for lps in token_lps]
        best = max(range(len(choices)), key=lambda i: (padded[i], -i))
    elif method == "unconditional":
        # The same tokens after only the token just before them: how likely the choice is without the content.
        context = [list(full[i][s - 1 :]) for i, s in enumerate(starts)]
        uncond = [_mean(lps) for lps in _prompt_logprobs(backend, context, 1)]
        meta["unconditional_logprobs"] = uncond
        scores = [m - u for m, u in zip(means, uncond)]
        best = _argmax(scores)
    else:
        scores = means
        best = _argmax(scores)
    meta["scores"] = scores
    meta["probs"] = _softmax(scores)
    return SelectResult(best, choices[best], meta)


def _prompt_logprobs(
    backend: Backend, ids: Sequence[Sequence[int]], start: int, text: str | None = None
) -> list[list[float]]:
    """``backend.prompt_logprobs`` in batches of ``SCORE_BATCH``, and of at most half the engine's queue: one
    request per choice, and an engine refuses a batch larger than its queue every time (a 429 no retry could fix;
    a batch that fits is retried while the queue is full)."""
    bound = backend.queue_bound()
    size = SCORE_BATCH if bound is None else max(1, min(SCORE_BATCH, bound // 2))
    rows: list[list[float]] = []
    for i in range(0, len(ids), size):
        rows += backend.prompt_logprobs(list(ids[i : i + size]), start, text)
    return rows


def _argmax(values: Sequence[float]) -> int:
    """First index of the maximum (ties go to the earlier choice)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def _softmax(values: Sequence[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    total = sum(exps)
    return [e / total for e in exps]
