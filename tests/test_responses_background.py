"""Background responses' bookkeeping without a model: the response store's bound on kept events, and a run
cancelled before its task ever ran."""

from __future__ import annotations

import asyncio

from radixserve.server.responses_background import BackgroundRun, BackgroundRuns
from radixserve.server.responses_store import ResponseStore, StoredResponse


def _entry(rid: str, events: int) -> StoredResponse:
    return StoredResponse({"id": rid}, (), tuple("x" * 100 for _ in range(events)) if events else None)


def test_the_store_bounds_kept_events_dropping_the_least_recently_used_first() -> None:
    store = ResponseStore(capacity=10, max_event_chars=1000)
    store.put(_entry("a", 4))
    store.put(_entry("b", 4))
    assert store.get("a") is not None  # a is now the most recently used
    store.put(_entry("c", 4))  # 1,200 characters: b's events go, b stays
    assert store.get("b").events is None and store.get("a").events is not None and store.get("c").events is not None
    assert store.event_chars == 800
    store.delete("a")
    store.put(_entry("c", 2))  # put again: the old copy's events are not counted twice
    assert store.event_chars == 200 and len(store) == 2


def test_a_run_cancelled_before_it_started_still_ends_final() -> None:
    async def scenario() -> tuple[BackgroundRun, list[str]]:
        ran: list[str] = []

        async def work(run: BackgroundRun) -> None:
            ran.append("work")  # never: cancelled first
            run.finish({"id": run.id, "status": "completed"})

        runs = BackgroundRuns()
        run = BackgroundRun("resp_1", lambda: {"status": "queued"}, True, abandon=lambda: {"status": "cancelled"})
        runs.start(run, work)
        await run.cancel()  # before the loop ever ran the task
        followers = [line async for line in run.follow(None)]
        assert not followers and len(runs) == 0
        return run, ran

    run, ran = asyncio.run(scenario())
    assert ran == [] and run.final == {"status": "cancelled"}
