"""The request as the engine sees it, and the typed messages it produces.

Phases are data, not states: a request has ``total`` tokens (prompt + generated so far) and ``num_computed`` of
them have their KV in the pool. Whatever lies between is what the next prefill chunk (or decode step) computes,
so a fresh prompt, a chunked prefill, a cache hit and a resumed retraction are one code path.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from radixserve.runtime.sampling_params import SamplingParams


class ErrorCode(str, enum.Enum):
    """Why a request finished with ``FinishReason.ERROR``: whether the client or the server is at fault."""

    ENGINE = "engine_error"  # a fault of the server (model step, a bug): HTTP 500
    GRAMMAR = "grammar_error"  # the request's own constraint cannot be followed (a backend limit, no output): 400
    INVALID = "invalid_request"  # the request is invalid for this engine (caught on submission): 400
    OVERLOADED = "overloaded"  # refused on submission, the waiting queue full (the front end's count lags): 429

    @property
    def client_fault(self) -> bool:
        return self in (ErrorCode.GRAMMAR, ErrorCode.INVALID)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id, a stop string, or a completed grammar
    LENGTH = "length"  # max_new_tokens or the context length reached
    ABORT = "abort"  # the client went away or asked to abort
    ERROR = "error"  # this request failed; ``Req.error`` says why


@dataclass
class TokenLogprob:
    """Log-probability of one token, with the ``top`` most likely alternatives at that position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # the tokens scored at least as high (itself included); given for the prompt's tokens


# Token ids are below this; salted cache ids (``Req.cache_ids``) are at or above it.
SALTED_IDS = 1 << 32


@functools.lru_cache(maxsize=4096)
def salt_offset(namespace: tuple[str | None, str | None]) -> int:
    """What a cache namespace (``Req.cache_namespace``: a cache_salt, an adapter) adds to token ids in the
    radix tree: a 64-bit hash of it, times ``SALTED_IDS`` (non-zero)."""
    digest = hashlib.blake2b(json.dumps(namespace).encode(), digest_size=8, person=b"radixsalt").digest()
    return (int.from_bytes(digest, "little") | 1) * SALTED_IDS


class Req:
    """One sequence in the engine. Owned and mutated by the scheduler thread only.

    Invariants:
      * ``len(slots) == num_computed`` and ``slots[i]`` holds the KV of ``all_ids[i]``;
      * ``slots[:prefix_len]`` belong to the radix tree (locked through ``prefix_handle``), the rest to this
        request alone, until they are handed to the tree;
      * ``num_computed <= total``; the request needs a forward pass over ``all_ids[num_computed:]``.
    """

    def __init__(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
    ) -> None:
        self.rid = rid
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.output_ids: list[int] = []
        self.num_computed = 0
        self.slots: list[int] = []
        # Tokens at the head of ``slots`` owned by the radix tree, and the lock that protects them.
        self.prefix_len = 0
        self.prefix_handle: Any = None
        # Prompt tokens whose KV came from the cache at first admission (reported as cached_tokens).
        self.cached_tokens: int | None = None
        self.finish_reason: FinishReason | None = None
        self.matched_stop: str | int | None = None
        self.error: str | None = None
        self.error_code: str | None = None  # an ``ErrorCode`` value when ``finish_reason`` is ERROR
        self.output_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob] = []
        # Sampling randomness (``runtime.sampler``): the request's seed (``params.seed``, or one from the engine's RNG
        # at its first draw) and how many uniforms it has drawn; draw k is a function of (seed, k) alone.
        self.rng_seed: int | None = None
        self.rng_draws = 0
        self.num_retractions = 0
        # Grammar matcher state (a constrained.Matcher) and the compile future it comes from.
        self.grammar: Any = None
        self.grammar_future: Any = None
        self.num_forced_tokens = 0
        # Speculative decoding: draft tokens proposed for the next step (verified there, never in output_ids until
        # accepted), and the drafter's per-request state (``runtime.speculative.SpecState``).
        self.draft_ids: list[int] = []
        # ``total`` when the drafts were proposed: they continue that sequence only (a step in between, e.g. a
        # prefill chunk after a retraction, moves the sequence and its grammar on, and they are dropped).
        self.draft_base = 0
        self.spec: Any = None
        # KV tier: chain keys of the complete chunks of ``all_ids`` hashed so far (``all_ids`` only grows, so they stay
        # valid); owned by ``KVCacheManager``, which extends them instead of hashing the prompt at every admission.
        self.tier_keys: list[str] = []
        self._salted_prompt: list[int] | None = None  # ``cache_ids`` of the prompt, in a cache namespace
        self.lora_key: str | None = None  # the adapter's cache key (``LoRAAdapter.key``), set when it is added
        # Embeddings (``params.pooling``): what the chunks computed so far gathered (a float32 tensor), then the
        # embedding, made when the prompt's last chunk is computed.
        self.pooled: Any = None
        self.embedding: list[float] | None = None
        # Text state, owned by the detokenizer.
        self.detok: Any = None
        self.stop_checker: Any = None
        self.output_text = ""
        self.sent_text_len = 0
        self.sent_token_len = 0
        self.sent_logprob_len = 0
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.admit_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids(self, start: int, end: int) -> list[int]:
        """``all_ids[start:end]`` without building ``all_ids`` (a decode step takes one token of each row)."""
        n = len(self.prompt_ids)
        if start >= n:
            return self.output_ids[start - n : end - n]
        if end <= n:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def cache_namespace(self) -> tuple[str | None, str | None] | None:
        """What keeps this request's cached KV apart: its cache_salt and its adapter's load (an adapter's KV differs
        from the base model's for the same tokens, and from that of an adapter loaded before under its name); None:
        the shared base-model cache. A pair, so that no salt can name an adapter's namespace."""
        if self.params.cache_salt is None and self.params.lora_name is None:
            return None
        return (self.params.cache_salt, self.lora_key or self.params.lora_name)

    @property
    def cache_ids(self) -> list[int]:
        """The ids the radix tree keys this request's KV by: ``all_ids``, or in a cache namespace (a ``cache_salt``,
        a LoRA adapter: ``cache_namespace``) each id moved above every token id by the namespace's
        hash, so that requests of other namespaces (or none) share no cached prefix with it, and cannot time one
        (vLLM's ``cache_salt``)."""
        namespace = self.cache_namespace
        if namespace is None:
            return self.all_ids
        offset = salt_offset(namespace)
        if self._salted_prompt is None:  # the prompt never changes: moved once
            self._salted_prompt = [t + offset for t in self.prompt_ids]
        return self._salted_prompt + [t + offset for t in self.output_ids]

    @property
    def total(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return 0 <= self.params.logprob_start_len < len(self.prompt_ids)

    @property
    def scoring_prompt(self) -> bool:
        """Whether prompt tokens are left to score: then its cached prefix stops where scoring resumes, and its
        steps compute logits at prompt positions. (Once all are scored it decodes, and resumes, as any other.)"""
        return self.wants_prompt_logprobs and self.next_logprob_pos < len(self.prompt_ids) - 1

    @property
    def next_logprob_pos(self) -> int:
        """The prompt position whose logits score the next prompt token not scored yet (position p scores token
        p + 1; scoring starts at ``logprob_start_len``). A resumed request scores only from here on, so no
        position is scored, and reported, twice."""
        return max(1, self.params.logprob_start_len) - 1 + len(self.prompt_logprobs)

    def fail(self, error: str, code: ErrorCode = ErrorCode.ENGINE) -> None:
        """Mark this request failed (the caller finishes it)."""
        self.finish_reason, self.error, self.error_code = FinishReason.ERROR, error, code.value

    def __repr__(self) -> str:
        return (
            f"Req({self.rid!r}, prompt={len(self.prompt_ids)}, out={len(self.output_ids)}, "
            f"computed={self.num_computed}, finish={self.finish_reason})"
        )


@dataclass
class ReqOutput:
    """An incremental update for one request, sent from the engine thread to whoever waits on it.

    ``text`` and ``token_ids`` are the part produced since the previous update; ``finished`` marks the last one.
    """

    rid: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    error: str | None = None
    error_code: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None
    # Seconds from arrival to admission into a batch; set on a request's first message only.
    queue_time: float | None = None
    # An embedding request's vector (``SamplingParams.pooling``), on its final message.
    embedding: list[float] | None = None
