"""Per-request sampling parameters, validated once at admission."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.constrained import ConstraintSpec
    from radixserve.runtime.pooling import Pooling

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_CACHE_SALT_CHARS = 1024
# Below this a temperature is greedy, as in vLLM: dividing logits by 1e-40 overflows float32 to inf (and then nan).
MIN_TEMPERATURE = 1e-5
# A repetition penalty divides or multiplies logits: outside this range they overflow, and no one needs it.
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass
class SamplingParams:
    """What to generate and how. ``validate`` raises ``ValueError`` with a message fit for an API client.

    ``temperature == 0`` (or below ``MIN_TEMPERATURE``) means greedy. ``top_k <= 0`` disables top-k.
    ``logprob_start_len >= 0`` asks for the log-probabilities of the prompt tokens from that position on (used to
    score choices).
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    skip_special_tokens: bool = True
    # vLLM's: keep a matched stop string at the end of the text (SGLang's no_stop_trim).
    include_stop_str_in_output: bool = False
    # vLLM's: only these tokens may be sampled (empty: any).
    allowed_token_ids: list[int] = field(default_factory=list)
    # vLLM's bad_words as token sequences: a sequence's last token is not sampled where the output ends with the
    # tokens before it (a one-token sequence: never). The server tokenizes the words.
    bad_words_ids: list[list[int]] = field(default_factory=list)
    # vLLM's priority, read by ``--schedule-policy priority`` (lower first).
    priority: int = 0
    # vLLM's cache_salt: requests share cached prefixes (and their timing) only with requests of the same salt.
    cache_salt: str | None = None
    # The LoRA adapter to run with (``--lora-modules``), by name; None: the base model.
    lora_name: str | None = None
    # Grammar the output must obey (JSON schema, regex, choices, CFG); compiled off the hot path.
    constraint: ConstraintSpec | None = None
    # An embedding request (``--runner pooling``): its prompt's hidden states pooled; it generates nothing.
    pooling: Pooling | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def edits_logits(self) -> bool:
        """Whether the sampler changes this request's logits before it picks (bias, penalties, allowed or banned
        tokens): then neither the argmax of the raw logits nor a speculative draft's check stands for it."""
        return bool(
            self.logit_bias
            or self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.allowed_token_ids
            or self.bad_words_ids
        )

    def validate(self, vocab_size: int) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens must be between 0 and max_new_tokens ({self.max_new_tokens}), "
                f"got {self.min_new_tokens}"
            )
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:  # also refuses nan
            raise ValueError(f"repetition_penalty must be in [{low:g}, {high:g}], got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop strings must be non-empty strings")
        banned = [t for seq in self.bad_words_ids for t in seq]
        for tid in list(self.stop_token_ids) + list(self.logit_bias) + list(self.allowed_token_ids) + banned:
            if not 0 <= int(tid) < vocab_size:
                raise ValueError(f"token id {tid} is out of range [0, {vocab_size})")
        if self.cache_salt is not None and not (
            isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS
        ):
            raise ValueError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
        if self.lora_name is not None and not (isinstance(self.lora_name, str) and self.lora_name.strip()):
            raise ValueError("lora_name must name an adapter (a non-empty string)")
        if any(not seq for seq in self.bad_words_ids):
            raise ValueError("bad_words_ids must be non-empty token sequences")
        if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if not 0 <= self.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs_num}")
        if self.pooling is not None and (
            self.max_new_tokens != 0 or self.constraint is not None or self.logprob_start_len >= 0
        ):
            raise ValueError("an embedding request computes its prompt only: no new tokens, constraint or log-probs")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
