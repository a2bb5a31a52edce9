"""``radixserve router``: the plain router process in front of radixserve replicas given by URL."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal

from fastapi import FastAPI

from radixserve.server.config import redacted
from radixserve.server.router.app import create_router_app
from radixserve.server.router.config import RouterConfig, RoutingConfig
from radixserve.server.router.replicas import ReplicaPool
from radixserve.server.router.transport import HttpTransport

logger = logging.getLogger("radixserve.router")


def build_http_router(config: RouterConfig, routing: RoutingConfig) -> FastAPI:
    """The router app over ``config.worker_urls`` with the policy ``routing`` describes."""
    pool = ReplicaPool(list(config.worker_urls), routing.make_policy())
    transport = HttpTransport(config.connect_timeout, config.own_key())
    return create_router_app(pool, transport, config.server_config(), routing)


def run_router(config: RouterConfig, routing: RoutingConfig) -> int:
    """Serve the router until SIGTERM or Ctrl+C (uvicorn's graceful shutdown lets streams in flight finish)."""
    import uvicorn

    from radixserve.server.app import attach_server
    from radixserve.server.lifecycle import uvicorn_options

    server_config = config.server_config()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per proxied request and health check
    logger.info("router config: %s", json.dumps(redacted(config)))
    logger.info("routing config: %s", json.dumps(dataclasses.asdict(routing)))
    app = build_http_router(config, routing)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_config=None,
        log_level=config.log_level,
        **uvicorn_options(server_config),
    )
    server = uvicorn.Server(uv_config)
    attach_server(app, server)
    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))

    async def run() -> int:
        await server.serve()
        if server.started:
            return 0
        return 1

    logger.info(
        "radixserve router: %d replicas, policy %s, on http://%s:%d",
        len(config.worker_urls),
        routing.policy,
        config.host,
        config.port,
    )
    try:
        return asyncio.run(run())
    except KeyboardInterrupt:
        return 0
