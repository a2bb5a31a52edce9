"""HTTP behaviour clients expect beyond the routes themselves, shared by the server and the router apps.

* CORS, so that a web page can call the API from a browser (vLLM's and SGLang's servers allow every origin by
  default; so does this one). ``--allowed-origins ''`` turns it off. Preflight requests are answered before any
  route or API-key check runs (a browser never sends credentials on a preflight); the actual request is then
  checked as any other.
* HEAD on every GET route (FastAPI registers only GET): monitors and load balancers probe with HEAD; the GET
  handler answers it, without the body.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.server.config import ServerConfig


def install_http_compat(app: FastAPI, config: ServerConfig) -> None:
    """HEAD on GET routes and CORS. Call it before adding the outermost middleware, so that error responses of
    the inner ones (413, 408, 401) carry the CORS headers too and a browser client can read them."""
    app.add_middleware(HeadAsGet)
    _install_cors(app, config)


def _install_cors(app: FastAPI, config: ServerConfig) -> None:
    """Answer CORS preflights and tag responses for the origins ``config`` allows (none: no CORS at all)."""
    if not config.allowed_origins:
        return
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(config.allowed_origins),
        allow_methods=list(config.allowed_methods),
        allow_headers=list(config.allowed_headers),
        allow_credentials=config.allow_credentials,
        expose_headers=["X-Request-Id"],
    )


class HeadAsGet:
    """ASGI middleware: a HEAD request is handled as the GET of the same path, its body dropped (headers kept, so
    Content-Length says what a GET would send). Routes without GET answer 405 as they would."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)
