"""Run one HTTP request through an ASGI app in-process, streaming its answer: how a Ray Serve replica serves the
radixserve app to the router without a socket of its own.

``call_asgi`` yields ``{"status": int, "headers": [(name, value), ...]}`` first, then the body's chunks (bytes) as
the app sends them. Closing the generator early (the router cancelled the request: its client went away) tells
the app its client disconnected, so the server aborts the request in the engine and frees its KV, exactly as if
an HTTP client had closed its connection.

The app sees ASGI spec 2.3, under which Starlette watches ``receive`` for ``http.disconnect`` while it streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.types import ASGIApp, Message

from radixserve.server.errors import error_body

_END = {"type": "bridge.end"}
APP_EXIT_WAIT_S = 5.0


async def call_asgi(
    app: ASGIApp, method: str, path: str, headers: list[tuple[str, str]], body: bytes
) -> AsyncIterator[dict[str, Any] | bytes]:
    """See the module docstring. ``path`` may carry a query string."""
    messages: asyncio.Queue[Message] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_pending = True

    async def receive() -> Message:
        nonlocal body_pending
        if body_pending:
            body_pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await messages.put(message)

    async def run() -> None:
        try:
            await app(_scope(method, path, headers), receive, send)
        except Exception as exc:  # noqa: BLE001 - reported to the caller as a 500 if nothing was sent yet
            await messages.put({"type": "bridge.error", "error": f"{type(exc).__name__}: {exc}"})
        finally:
            await messages.put(_END)

    task = asyncio.ensure_future(run())
    try:
        started = False
        while True:
            message = await messages.get()
            kind = message["type"]
            if kind == "http.response.start":
                started = True
                raw = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                yield {"status": message["status"], "headers": raw}
            elif kind == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
            elif kind in ("bridge.error", "bridge.end") and not started:
                why = message.get("error", "the app ended without a response")
                yield {"status": 500, "headers": [("content-type", "application/json")]}
                yield _json(error_body(500, f"internal error: {why}", None, "internal_error"))
                return
            elif kind == "bridge.end":
                return
    finally:
        disconnected.set()
        done, _ = await asyncio.wait({task}, timeout=APP_EXIT_WAIT_S)
        if not done:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


def _json(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload).encode()


def _scope(method: str, path: str, headers: list[tuple[str, str]]) -> dict[str, Any]:
    path, _, query = path.partition("?")
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method.upper(),
        "scheme": "http",
        "path": path,
        "raw_path": path.encode("latin-1"),
        "query_string": query.encode("latin-1"),
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
