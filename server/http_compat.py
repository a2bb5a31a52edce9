"""HTTP behaviour clients expect beyond the routes themselves, shared by the server, the router and Ray Serve.

* CORS, so that a web page can call the API from a browser. By default only pages served from this machine
  (``localhost``, ``127.0.0.1``, ``[::1]``, any port) may: a server without an API key would otherwise let any web
  site its user visits run generations on it and read the answers. ``--allowed-origins '*'`` allows every origin
  (vLLM's and SGLang's default), a list names them (``https://*.example.com``: one label; ``:*``: any port or
  none), ``--allowed-origins ''`` turns CORS off. Preflights are answered before any route or API-key check runs
  (a browser never sends credentials on one); the actual request is then checked as any other.
* HEAD on every GET route (FastAPI registers only GET): monitors and load balancers probe with HEAD; the GET
  handler answers it, without the body.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import Message, Receive, Scope, Send

from radixserve.server.asgi import HttpMiddleware
from radixserve.server.config import CorsConfig


def install_http_compat(app: FastAPI, config: CorsConfig) -> None:
    """HEAD on GET routes and CORS. Call it before adding the outermost middleware, so that error responses of
    the inner ones (413, 408, 401) carry the CORS headers too and a browser client can read them."""
    app.add_middleware(HeadAsGet)
    if not config.allowed_origins:
        return
    app.add_middleware(
        CORSMiddleware,
        allow_origins=[o for o in config.allowed_origins if "*" not in o or o == "*"],
        allow_origin_regex=config.origin_regex(),
        allow_methods=list(config.allowed_methods),
        allow_headers=list(config.allowed_headers),
        allow_credentials=config.allow_credentials,
        expose_headers=["X-Request-Id"],
    )


class HeadAsGet(HttpMiddleware):
    """A HEAD request is handled as the GET of the same path, its body dropped (headers kept, so Content-Length
    says what a GET would send). Routes without GET answer 405 as they would."""

    async def http(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)
