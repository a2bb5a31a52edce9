"""Requests in flight: submit to the engine, read their outputs on the event loop, abort when abandoned.

``RequestGroup`` is the unit a route works with: the ``n`` choices of one OpenAI call, or a /generate batch.
Submission is eager and all-or-nothing, so a request the engine refuses becomes an HTTP error before any
response byte is sent, and never leaves a sibling running.

Invariant: once ``close()`` has run, no request of the group is running in the engine (it was finished or
aborted), so a client that goes away frees its KV at once. Routes call ``close()`` in ``finally``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from radixserve.runtime.request import FinishReason, ReqOutput, TokenLogprob
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.server.errors import APIError, from_engine_error
from radixserve.server.metrics import Metrics

DISCONNECT_POLL_S = 0.2
_DISCONNECTED = -1


@dataclass
class Result:
    """Everything one request produced, accumulated from its output deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    error: str | None = None
    error_code: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None
    embedding: list[float] | None = None

    def add(self, out: ReqOutput) -> None:
        self.text += out.text
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        if out.finished:
            self.finish_reason = out.finish_reason
            self.matched_stop = out.matched_stop
            self.error = out.error
            self.error_code = out.error_code
            self.prompt_tokens = out.prompt_tokens
            self.completion_tokens = out.completion_tokens
            self.cached_tokens = out.cached_tokens
            self.prompt_logprobs = out.prompt_logprobs
            self.embedding = out.embedding


class RequestGroup:
    """Requests submitted together and read as one stream of ``(index, ReqOutput)``."""

    def __init__(
        self,
        engine: Any,
        metrics: Metrics,
        inflight: dict[str, RequestGroup],
        native: bool = False,
        name: str | None = None,
    ) -> None:
        self.engine = engine
        self.name = name  # the id a client knows the whole group by (a completion's id), for /abort_request
        self.metrics = metrics
        self.inflight = inflight
        self.native = native
        self.rids: list[str] = []
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[tuple[int, ReqOutput | None]] = asyncio.Queue()
        self._done: list[bool] = []
        self._start: list[float] = []
        self._last: list[float | None] = []

    def submit(self, requests: Sequence[tuple[list[int], SamplingParams, str | None]]) -> None:
        """Submit every request or none: on the first refusal the ones already queued are aborted. A rid that a
        running request already has is a 409 (the engine would refuse it too, but only after queueing it)."""
        for index, (prompt_ids, params, rid) in enumerate(requests):
            if rid is not None and rid in self.inflight:
                self.close()
                raise APIError(
                    409, f"a running request already has rid {rid!r}; give each request its own", param="rid"
                )
            try:
                rid = self.engine.submit(prompt_ids, params, self._sink(index), rid)
            except Exception as exc:  # noqa: BLE001 - mapped to the HTTP status the client should see
                self.close()
                error = from_engine_error(exc, self.native)
                if error.status == 429:
                    self.metrics.refused_request("queue_full")
                raise error from None
            self.rids.append(rid)
            self._done.append(False)
            self._start.append(time.monotonic())
            self._last.append(None)
            self.inflight[rid] = self

    def _sink(self, index: int) -> Any:
        def put(out: ReqOutput) -> None:  # runs on the engine thread
            # A closed loop means the server is gone and nobody waits for this output any more.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, out))

        return put

    @property
    def finished(self) -> bool:
        return all(self._done)

    async def __aiter__(self) -> AsyncIterator[tuple[int, ReqOutput]]:
        while not self.finished:
            index, out = await self._queue.get()
            if index == _DISCONNECTED:
                self.close()
                raise APIError(499, "the client closed the connection")
            assert out is not None
            if self._done[index]:
                continue  # the final output of a request this group already closed
            self._record(index, out)
            yield index, out

    def _record(self, index: int, out: ReqOutput) -> None:
        now = time.monotonic()
        if out.queue_time is not None:  # (on a request's first message)
            self.metrics.queued(out.queue_time)
        if out.completion_tokens > 0:  # time to a first token, and between tokens, only where tokens came
            last = self._last[index]  # (a prefill-only request, a select's scoring, a failure: none)
            if last is None:
                self.metrics.first_token(now - self._start[index])
            else:
                self.metrics.next_output(now - last)
            self._last[index] = now
        if out.finished:
            self._done[index] = True
            self.inflight.pop(self.rids[index], None)
            self.metrics.finished(out, now - self._start[index])

    async def collect(self, request: Request | None = None) -> list[Result]:
        """Wait for every request to finish; abort them all if ``request``'s client disconnects meanwhile."""
        results = [Result() for _ in self.rids]
        watcher = asyncio.ensure_future(self._watch(request)) if request is not None else None
        try:
            async for index, out in self:
                results[index].add(out)
        finally:
            if watcher is not None:
                watcher.cancel()
            self.close()
        return results

    async def _watch(self, request: Request) -> None:
        while not self.finished:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await request.is_disconnected():
                self._queue.put_nowait((_DISCONNECTED, None))
                return

    def close(self) -> None:
        """Abort every request of the group that has not finished. Idempotent."""
        for index, rid in enumerate(self.rids):
            if not self._done[index]:
                self._done[index] = True
                self.inflight.pop(rid, None)
                self.engine.abort(rid)
                self.metrics.abandoned()
