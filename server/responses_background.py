"""Background responses (``background: true``): the response runs on in the server, and the client polls it,
streams it again from any event, or cancels it.

Ownership. The front end's event loop owns every ``BackgroundRun`` in ``BackgroundRuns``, from the create call
until the response reaches a final status (completed, incomplete, failed or cancelled); then the response, with
the events of a streamed one, moves to the response store (``server.responses_store``), which serves it from then
on. Only the event loop touches these objects, so they need no lock.

Invariants: a run's ``events[i]`` is the event whose ``sequence_number`` is ``i``; ``final`` is set once, before
``done``; a follower that saw ``done`` has read every event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from radixserve.server.errors import APIError


class BackgroundRun:
    """One background response while it runs. ``render()`` is the response object as it is now (status
    ``queued`` or ``in_progress``, the output made so far); ``keep_events`` (it was created with ``stream: true``)
    keeps its events for replay."""

    def __init__(
        self,
        response_id: str,
        render: Callable[[], dict[str, Any]],
        keep_events: bool,
        abandon: Callable[[], dict[str, Any]],
    ) -> None:
        self.id = response_id
        self.render = render
        self.abandon = abandon  # stops the requests and stores the response ``cancelled``, for a task that never ran
        self.keep_events = keep_events
        self.events: list[str] = []
        self.final: dict[str, Any] | None = None
        self.task: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()

    @property
    def done(self) -> bool:
        return self.final is not None

    def snapshot(self) -> dict[str, Any]:
        """The response as a poll sees it now."""
        return self.final if self.final is not None else self.render()

    def publish(self, lines: Sequence[str]) -> None:
        if self.keep_events and lines:
            self.events += lines
            self._notify()

    def finish(self, response: dict[str, Any]) -> None:
        self.final = response
        self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def follow(self, after: int | None) -> AsyncIterator[str]:
        """The events after sequence number ``after`` (all of them for None), then each as it comes, until the
        response is final. Leaving early leaves the response running."""
        i = 0 if after is None else after + 1
        while True:
            changed = self._changed
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.done:
                return
            await changed.wait()

    async def cancel(self) -> None:
        """Stop the run (its engine requests are aborted) and wait until it has recorded its final response. (A
        caller cancelled meanwhile is cancelled, as ever; the run still ends on its own.)"""
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.wait({self.task})


class BackgroundRuns:
    """The background responses still running, by id."""

    def __init__(self) -> None:
        self._runs: dict[str, BackgroundRun] = {}

    def start(self, run: BackgroundRun, work: Callable[[BackgroundRun], Any]) -> None:
        """Run ``work(run)`` as a task of the event loop; the run is listed until the task ends."""
        self._runs[run.id] = run
        run.task = asyncio.ensure_future(work(run))
        run.task.add_done_callback(lambda _: self._ended(run))

    def _ended(self, run: BackgroundRun) -> None:
        if run.final is None:  # cancelled before it ever ran: nothing of it recorded the end
            run.finish(run.abandon())
        self._runs.pop(run.id, None)

    def running(self) -> list[BackgroundRun]:
        return list(self._runs.values())

    def get(self, response_id: str) -> BackgroundRun | None:
        return self._runs.get(response_id)

    def __len__(self) -> int:
        return len(self._runs)


def replay(events: Sequence[str], after: int | None) -> AsyncIterator[str]:
    """A finished background response's events after sequence number ``after``."""

    async def gen() -> AsyncIterator[str]:
        for line in events[0 if after is None else after + 1 :]:
            yield line

    return gen()


def not_streamable(response_id: str) -> APIError:
    return APIError(
        400,
        f"response {response_id!r} cannot be streamed again: only a response created with background: true and "
        "stream: true keeps its events (and, once the store is full of events, only the most recent ones); "
        "retrieve it without stream",
        param="stream",
    )
