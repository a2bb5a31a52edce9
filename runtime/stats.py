"""Counters the engine keeps for logs, /server_info and Prometheus. Written by the engine thread only."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineStats:
    requests_finished: int = 0
    requests_aborted: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission only)
    cached_prompt_tokens: int = 0  # of those, served from the radix cache
    generated_tokens: int = 0
    forward_steps: int = 0
    overlapped_steps: int = 0  # of those, launched before the step before them was read back (CUDA overlap)
    retractions: int = 0
    forced_tokens: int = 0  # appended by jump-forward, without a forward pass of their own
    spec_steps: int = 0  # speculative verifications (one per request and step that had drafts)
    spec_draft_tokens: int = 0  # draft tokens verified
    spec_accepted_tokens: int = 0  # of those, accepted

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_tokens_per_step(self) -> float:
        """Tokens a speculating request gained per verification: its accepted drafts plus the token after them."""
        return (self.spec_accepted_tokens + self.spec_steps) / self.spec_steps if self.spec_steps else 0.0

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        d: dict[str, float] = dict(asdict(self))
        d["cache_hit_rate"] = self.cache_hit_rate
        d["spec_acceptance_rate"] = self.spec_acceptance_rate
        d["spec_tokens_per_step"] = self.spec_tokens_per_step
        return d
