"""The batch token bitmask: one int32 row of ``ceil(V / 32)`` words per request, bit ``t % 32`` of word ``t // 32``
set when token ``t`` is allowed.

Invariants:
  * ``allocate_bitmask`` returns all ones (every token allowed), so rows of unconstrained requests need no work;
  * ``fill_bitmasks`` writes only the rows it is given (in parallel, without the GIL, for llguidance matchers);
  * ``apply_bitmask`` is one vectorized masking of the whole batch; logit columns past the bitmask (vocabulary
    padding) are always disallowed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import llguidance
import torch

from radixserve.constrained.backend import LLGuidanceMatcher, Matcher, check_bitmask

_EXECUTOR: llguidance.LLExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()
_BITS: dict[torch.device, torch.Tensor] = {}


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """An all-ones int32 ``[batch_size, ceil(vocab_size / 32)]`` CPU bitmask (pinned when CUDA is present)."""
    pin = torch.cuda.is_available()
    return torch.full((batch_size, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin)


def _executor() -> llguidance.LLExecutor:
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = llguidance.LLExecutor()
        return _EXECUTOR


def fill_bitmasks(rows: Sequence[tuple[Matcher, int]], bitmask: torch.Tensor, parallel: bool = True) -> None:
    """Write each matcher's allowed tokens into its row of ``bitmask``; with ``parallel``, llguidance rows are
    computed on llguidance's thread pool, else one after another on the calling thread."""
    fast: list[tuple[llguidance.LLMatcher, int]] = []
    for matcher, row in rows:
        if not 0 <= row < bitmask.shape[0]:
            raise ValueError(f"row {row} is outside a bitmask of {bitmask.shape[0]} rows")
        pooled = parallel and isinstance(matcher, LLGuidanceMatcher) and bitmask.shape[1] == matcher.words
        if pooled and bitmask.is_contiguous():
            fast.append((matcher.ll_matcher, row))
        else:
            matcher.fill_bitmask(bitmask, row)
    if fast:
        check_bitmask(bitmask, bitmask.shape[1])
        _executor().unsafe_compute_mask_ptr(fast, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])


def _bits(device: torch.device) -> torch.Tensor:
    if device not in _BITS:
        _BITS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return _BITS[device]


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The ``[B, vocab_size]`` bool mask (True = allowed) of a bitmask; ids past its words are False."""
    device = torch.device(device) if device is not None else bitmask.device
    words = bitmask.to(device, non_blocking=True)
    allowed = ((words[:, :, None] >> _bits(device)) & 1).bool().reshape(words.shape[0], -1)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(words.shape[0], vocab_size - allowed.shape[1], dtype=torch.bool, device=device)
    return torch.cat([allowed, pad], dim=1)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: ``logits[b, t] = -inf`` wherever bit ``t`` of row ``b`` is clear (``logits`` is ``[B, V']``)."""
    if logits.dim() != 2 or bitmask.dim() != 2 or logits.shape[0] != bitmask.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)} do not match")
    if bitmask.dtype != torch.int32:
        raise ValueError("bitmask must be int32")
    allowed = bitmask_to_bool(bitmask, logits.shape[1], logits.device)
    logits.masked_fill_(~allowed, float("-inf"))
