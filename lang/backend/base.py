"""What the DSL needs from a serving backend, and the role markers every backend derives the same way.

A backend is shared by every state of every program run with it, so all methods must be thread-safe.
"""

from __future__ import annotations

import random
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.lang.chat_template import RoleMarkers, derive_markers


@dataclass
class GenOutput:
    """One finished generation. ``meta`` has the server's ``meta_info`` keys: ``prompt_tokens``,
    ``completion_tokens``, ``cached_tokens``, ``finish_reason`` and, when asked, ``output_token_logprobs`` /
    ``output_top_logprobs`` (``[logprob, token_id, token_text]`` triples)."""

    text: str
    output_ids: list[int] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


def overload_backoff_s(attempt: int) -> float:
    """The wait before sending again a request refused for a full queue (429), attempt 0, 1, ...: growing from 50
    ms to 2 s, with jitter (x0.5-1.5) so that a ``run_batch``'s threads do not all come back together."""
    return min(0.05 * 2**attempt, 2.0) * (0.5 + random.random())


class Backend(ABC):
    def __init__(self) -> None:
        self._markers: RoleMarkers | None = None
        self._markers_lock = threading.Lock()

    @abstractmethod
    def generate(
        self,
        prompt: str,
        sampling: dict[str, Any],
        *,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        on_text: Callable[[str], None] | None = None,
    ) -> GenOutput:
        """Generate after ``prompt`` with the server-style ``sampling`` dict.

        With ``on_text`` the answer is streamed: ``on_text`` gets each new piece of text as it is produced, and the
        pieces join to exactly ``GenOutput.text``. Raises ``BackendError`` with the server's message.
        """

    @abstractmethod
    def prefill(self, prompt: str) -> dict[str, Any]:
        """Compute ``prompt`` without generating, so its KV is in the prefix cache for the requests that follow.
        Returns the request's ``meta_info``."""

    @abstractmethod
    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text exactly as the backend tokenizes a text prompt."""

    @abstractmethod
    def prompt_logprobs(
        self, input_ids: list[list[int]], start: int, routing_text: str | None = None
    ) -> list[list[float]]:
        """For each sequence, the log-probabilities of its tokens ``start, start + 1, ...`` given the tokens before
        them (``start >= 1``), from one batched request so a shared head is computed once. ``routing_text``: the
        text the sequences continue, for a router in front of the server to route by (it has no tokenizer)."""

    @abstractmethod
    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """``messages`` rendered through the served model's chat template."""

    @abstractmethod
    def server_info(self) -> dict[str, Any]:
        """The engine's state and counters (``cache_stats``, ``kv_cache``, ...), as ``/server_info`` has them."""

    @abstractmethod
    def flush_cache(self) -> None:
        """Drop every cached prefix (the server refuses while requests run: ``BackendError``)."""

    def queue_bound(self) -> int | None:
        """The most requests the engine queues (``--max-queued-requests``), or None where unknown: ``select``
        scores its choices in batches that fit."""
        return None

    def role_markers(self) -> RoleMarkers:
        """The served model's role markers, derived once (see ``lang.chat_template``)."""
        with self._markers_lock:
            if self._markers is None:
                self._markers = derive_markers(self.render_chat)
            return self._markers

    def cache_stats(self) -> dict[str, Any]:
        """Prefix-cache counters: ``prompt_tokens``, ``cached_prompt_tokens``, ``cache_hit_rate``, ..."""
        return dict(self.server_info()["cache_stats"])
