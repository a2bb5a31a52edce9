"""Graceful shutdown, and the uvicorn settings the server runs with.

On SIGTERM (or anything that sets uvicorn's ``should_exit``), uvicorn and the app cooperate:
  1. uvicorn closes its listening socket (new connections are refused) and closes idle keep-alive connections;
     a connection busy with a response is closed once that response ends;
  2. ``drain_on_exit`` marks the server draining: a request that still arrives on an open connection gets 503
     with Retry-After, and /health answers 503 ``{"status": "draining"}``;
  3. requests in flight keep running for up to ``--shutdown-grace-period`` seconds; those still unfinished then
     are aborted, so a stream ends with finish_reason "abort" and [DONE], and a non-streaming call returns what
     was generated, with finish_reason "abort";
  4. once every connection has closed, background Responses (``background: true``, which outlive their
     connections) get what is left of the grace period, then their requests are aborted, so each ends
     ``incomplete`` and stored (``finish_background``);
  5. the lifespan shutdown stops the engine (when the app built it) and the process exits with status 0.
uvicorn's ``timeout_graceful_shutdown`` is the grace period plus a margin: a backstop that cancels whatever is
left, never the normal path.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from radixserve.server.config import ServerConfig
from radixserve.server.connections import guarded_h11
from radixserve.server.state import ServerState

logger = logging.getLogger("radixserve.server")

EXIT_POLL_S = 0.1
DRAIN_POLL_S = 0.05
SHUTDOWN_MARGIN_S = 5.0


def uvicorn_options(config: ServerConfig) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.Config`` that every way of serving the app shares."""
    return {
        "http": guarded_h11(config.request_read_timeout),
        "timeout_graceful_shutdown": config.shutdown_grace_period + SHUTDOWN_MARGIN_S,
    }


async def drain_on_exit(state: ServerState) -> None:
    """Wait for uvicorn to be asked to exit, then drain (see the module docstring). Runs until cancelled by the
    lifespan shutdown; after the grace period it keeps aborting whatever is still in flight (a request whose
    grammar was compiling when the sweep ran submits late)."""
    while state.exit_requested is None or not state.exit_requested():
        await asyncio.sleep(EXIT_POLL_S)
    state.draining = True
    loop = asyncio.get_running_loop()
    grace = state.config.shutdown_grace_period
    state.drain_deadline = loop.time() + grace
    if state.inflight:
        logger.info("shutting down: %d requests in flight get up to %g s to finish", len(state.inflight), grace)
    else:
        logger.info("shutting down: no requests in flight")
    deadline = loop.time() + grace
    while state.inflight and loop.time() < deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    aborted: set[str] = set()
    while True:
        late = [rid for rid in state.inflight if rid not in aborted]
        engine = state.engine
        if late and engine is not None:
            logger.warning("shutdown grace period over: aborting %d unfinished requests", len(late))
            for rid in late:
                engine.abort(rid)
            aborted.update(late)
        await asyncio.sleep(DRAIN_POLL_S)


async def finish_background(state: ServerState) -> None:
    """At the lifespan's end (every connection closed): let background responses run until the grace period ends,
    then abort their requests (each ends ``incomplete`` and is stored), and stop any run still left."""
    runs = state.background
    if not len(runs):
        return
    state.draining = True
    loop = asyncio.get_running_loop()
    if state.drain_deadline is None:
        state.drain_deadline = loop.time() + state.config.shutdown_grace_period
    logger.info("shutting down: %d background responses get until the grace period ends", len(runs))
    while len(runs) and loop.time() < state.drain_deadline:
        await asyncio.sleep(DRAIN_POLL_S)
    engine = state.engine
    if len(runs) and engine is not None:
        logger.warning("shutdown grace period over: aborting %d background responses", len(runs))
        for rid in list(state.inflight):
            engine.abort(rid)
        settle = loop.time() + SHUTDOWN_MARGIN_S
        while len(runs) and loop.time() < settle:
            await asyncio.sleep(DRAIN_POLL_S)
    for run in runs.running():
        await run.cancel()
