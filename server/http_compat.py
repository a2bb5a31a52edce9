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

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import Message, Receive, Scope, Send

from radixserve.server.asgi import HttpMiddleware

LOOPBACK_ORIGINS = tuple(f"{s}://{h}:*" for s in ("http", "https") for h in ("localhost", "127.0.0.1", "[::1]"))


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help, "choices": None, "secret": False})


@dataclass(frozen=True)
class CorsConfig:
    """The CORS flags (a base of ``ServerConfig``, ``RouterConfig`` and ``RayServeConfig``). Subclasses call
    ``check_cors`` from their ``__post_init__``."""

    allowed_origins: tuple[str, ...] = _opt(
        LOOPBACK_ORIGINS,
        "Origins of the web pages that may call the API from a browser (CORS): '*' for any, "
        "https://*.example.com for one label, :* for any port; '' turns CORS off. Default: pages on this machine.",
    )
    allowed_methods: tuple[str, ...] = _opt(("*",), "HTTP methods a cross-origin preflight may ask for (CORS).")
    allowed_headers: tuple[str, ...] = _opt(("*",), "Request headers a cross-origin preflight may ask for (CORS).")
    allow_credentials: bool = _opt(
        False, "Let cross-origin pages send cookies / HTTP auth (CORS); only with origins named, not '*'."
    )

    def check_cors(self) -> None:
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            object.__setattr__(self, name, _items(getattr(self, name), name))
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError(
                "--allow-credentials needs the origins named in --allowed-origins: browsers refuse credentials for '*'"
            )
        for origin in self.allowed_origins:
            if origin != "*" and not re.fullmatch(r"https?://[^/?#\s]+", origin):
                raise ValueError(
                    f"--allowed-origins takes origins like https://app.example.com (scheme and host, no path), "
                    f"'*' or ''; got {origin!r}"
                )

    def origin_regex(self) -> str | None:
        """One regex for the origins given as patterns (with ``*``), None when there are none."""
        patterns = [_pattern_regex(o) for o in self.allowed_origins if o != "*" and "*" in o]
        return "|".join(f"(?:{p})" for p in patterns) or None


def cors_fields(config: CorsConfig) -> dict[str, Any]:
    """``config``'s CORS settings as keyword arguments (to build a ``ServerConfig`` from another config)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(CorsConfig)}


def _items(value: str | tuple[str, ...], name: str) -> tuple[str, ...]:
    """The values of a list flag: '' gives none; vLLM's JSON spelling ('["https://a", "https://b"]') is read."""
    items = [value] if isinstance(value, str) else list(value)
    if len(items) == 1 and items[0].strip().startswith("["):
        try:
            parsed = json.loads(items[0])
        except ValueError:
            raise ValueError(f"--{name.replace('_', '-')}: {items[0]!r} is not a JSON list of strings") from None
        if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
            raise ValueError(f"--{name.replace('_', '-')}: {items[0]!r} is not a JSON list of strings")
        items = parsed
    return tuple(v.strip() for v in items if v.strip())


def _pattern_regex(origin: str) -> str:
    """``https://*.example.com`` -> one DNS label in place of the ``*``; a trailing ``:*``: any port or none."""
    any_port = origin.endswith(":*")
    body = origin[:-2] if any_port else origin
    regex = re.escape(body).replace(r"\*", "[A-Za-z0-9-]+")
    return regex + (r"(?::[0-9]{1,5})?" if any_port else "")


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
