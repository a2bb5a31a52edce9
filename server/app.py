"""The app factory: ``create_app(engine_or_factory, server_config)`` builds the FastAPI application.

Given an ``Engine``, the app serves it at once and leaves it running on shutdown (the caller owns it). Given a
factory (any callable returning an ``Engine``), the app builds the engine on a background thread when it
starts, answers /health with 503 meanwhile, and shuts the engine down when it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

from radixserve.server import (
    anthropic_messages,
    lora_routes,
    native_routes,
    openai_chat,
    openai_completions,
    openai_embeddings,
    openai_models,
    openai_responses,
    score_routes,
)
from radixserve.server.config import ServerConfig
from radixserve.server.errors import install_error_handlers
from radixserve.server.http_compat import install_http_compat
from radixserve.server.lifecycle import drain_on_exit, finish_background
from radixserve.server.limits import RequestLimits
from radixserve.server.request_id import RequestIdMiddleware
from radixserve.server.state import EngineFactory, ServerState

if TYPE_CHECKING:
    from radixserve.runtime.engine import Engine

logger = logging.getLogger("radixserve.server")

READY_POLL_S = 0.05


def create_app(
    engine_or_factory: Engine | EngineFactory,
    server_config: ServerConfig | None = None,
    *,
    model: str | None = None,
) -> FastAPI:
    """Build the app.

    ``model`` is the --model spec (needed with a factory, taken from the engine otherwise); clients may name
    the model by it or by the served name. Call ``attach_server`` before serving the app with uvicorn, so the
    ready line waits for the socket and shows the address really bound.
    """
    config = server_config or ServerConfig()
    spec = model or getattr(engine_or_factory, "model_name", None)
    if spec is None:
        raise ValueError("create_app needs model=<the --model spec> when given an engine factory")
    state = ServerState(engine_or_factory, config, spec)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.start_loading()
        announcer = asyncio.ensure_future(_announce_ready(state))
        drainer = asyncio.ensure_future(drain_on_exit(state))
        try:
            yield
        finally:
            announcer.cancel()
            await finish_background(state)
            drainer.cancel()
            state.shutdown()

    app = FastAPI(
        title="radixserve",
        summary="An LLM serving engine with a radix prefix cache: OpenAI-compatible and SGLang-style APIs.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(
        RequestLimits,
        max_body_bytes=config.max_body_bytes,
        max_json_depth=config.max_json_depth,
        read_timeout=config.request_read_timeout,
    )
    install_http_compat(app, config)
    app.add_middleware(RequestIdMiddleware)  # outermost: every response, errors of the limits included
    app.include_router(native_routes.health_router)
    app.include_router(openai_chat.router)
    app.include_router(openai_completions.router)
    app.include_router(openai_embeddings.router)
    app.include_router(score_routes.router)
    app.include_router(openai_responses.router)
    app.include_router(anthropic_messages.router)
    app.include_router(openai_models.router)
    app.include_router(native_routes.router)
    app.include_router(lora_routes.router)
    return app


def attach_server(app: FastAPI, server: uvicorn.Server) -> None:
    """Tell the app which uvicorn server runs it: the ready line then waits until it listens, with its address,
    and a shutdown of that server drains the app's requests first (``server.lifecycle``). Build the server's
    config with ``server.lifecycle.uvicorn_options``."""
    state = app.state.server
    state.listen_url = functools.partial(_bound_url, server)
    state.exit_requested = lambda: bool(server.should_exit)


def _bound_url(server: uvicorn.Server) -> str | None:
    if not server.started or not server.servers or not server.servers[0].sockets:
        return None
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    return f"http://{host}:{port}"


async def _announce_ready(state: ServerState) -> None:
    """Log the one unmistakable ready line once the engine is loaded and the socket listens."""
    # Polled rather than waited on in a thread: a worker thread blocked on the event would hold up shutdown.
    while not state.ready_event.is_set() or (state.listen_url is not None and state.listen_url() is None):
        if state.load_error:
            break
        await asyncio.sleep(READY_POLL_S)
    if state.load_error:
        logger.error("radixserve failed to start: %s", state.load_error)
        return
    if state.engine is not None:
        url = state.listen_url() if state.listen_url is not None else None
        logger.info("%s", state.ready_message(url))
