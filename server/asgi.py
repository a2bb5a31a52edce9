"""The base of the server's pure ASGI middlewares (no buffering: streamed responses pass through as they come)."""

from __future__ import annotations

from typing import Any


class HttpMiddleware:
    """Wraps ``app``; HTTP requests go to ``http``, every other scope (lifespan) passes through untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.http(scope, receive, send)

    async def http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise NotImplementedError
