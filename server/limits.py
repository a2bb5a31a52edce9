"""Limits on what a request body may be, enforced before any route parses it (a pure ASGI middleware).

For every POST/PUT/PATCH request the body is read in full, then replayed to the app:
  * larger than ``max_body_bytes`` (by its Content-Length, or as it arrives): 413, and the connection is closed;
  * not fully sent within ``read_timeout`` seconds (a half-sent body, a stalled client): 408, connection closed;
  * not valid UTF-8, or a JSON string with a lone UTF-16 surrogate escape (``"\\ud800"``, which JSON allows but no
    tokenizer or UTF-8 encoder takes): 400;
  * arrays/objects nested deeper than ``max_json_depth``: 400 (the JSON parser and the validators recurse; a
    bounded depth keeps a hostile body from reaching Python's recursion limit or wasting CPU).
Every refusal has OpenAI's error shape. After the body, the app's ``receive`` falls through to the server's, so
disconnect detection (``request.is_disconnected()``) keeps working.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import numpy as np
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.server.errors import ANTHROPIC_PATHS, anthropic_error_body, error_body

BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_CHUNK = 1 << 20  # bytes measured per vectorized pass: bounded memory whatever the body's size
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # a \uD800-\uDFFF escape (or an escaped backslash before one)
_OPEN = np.frombuffer(b"[{", dtype=np.uint8)
_CLOSE = np.frombuffer(b"]}", dtype=np.uint8)


def json_depth(body: bytes) -> int:
    """Deepest nesting of arrays/objects in ``body`` (0 for a scalar); brackets inside strings do not count.

    Linear time, vectorized over 1 MiB chunks (so a hostile body costs neither a regex's backtracking nor memory
    in proportion to its size). A quote preceded by an odd run of backslashes is escaped. On invalid JSON the
    result is whatever the brackets outside strings say, which the parser then refuses anyway.
    """
    depth = deepest = 0
    inside = 0  # 1 while in a string at a chunk boundary
    run = 0  # backslashes at the end of the previous chunk
    for start in range(0, len(body), _CHUNK):
        c = np.frombuffer(body, dtype=np.uint8, count=min(_CHUNK, len(body) - start), offset=start)
        idx = np.arange(c.size, dtype=np.int64)
        is_bs = c == _BACKSLASH
        last_plain = np.maximum.accumulate(np.where(is_bs, -1 - run, idx))
        before = np.empty(c.size, dtype=np.int64)  # backslashes right before each position
        before[0] = run
        before[1:] = idx[:-1] - last_plain[:-1]
        quotes = np.cumsum((c == _QUOTE) & (before % 2 == 0)) + inside
        outside = quotes % 2 == 0
        steps = (np.isin(c, _OPEN) & outside).astype(np.int64) - (np.isin(c, _CLOSE) & outside).astype(np.int64)
        levels = np.cumsum(steps) + depth
        deepest = max(deepest, int(levels.max()))
        depth = int(levels[-1])
        inside = int(quotes[-1] % 2)
        run = int(c.size - 1 - last_plain[-1])
    return deepest


class _TooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


class RequestLimits:
    """ASGI middleware: ``app.add_middleware(RequestLimits, max_body_bytes=..., max_json_depth=...,
    read_timeout=...)``."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, max_json_depth: int, read_timeout: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_json_depth = max_json_depth
        self.read_timeout = read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            await self.app(scope, receive, send)
            return
        encoding = _header(scope, b"content-encoding").strip().lower()
        if encoding not in ("", "identity"):  # (read as UTF-8 JSON it failed with a message about the bytes)
            message = f"Content-Encoding {encoding!r} is not supported: send the body uncompressed"
            await _refuse(scope, send, 415, message, "unsupported_encoding", close=True)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await _refuse(scope, send, 413, self._too_large(declared), "body_too_large", close=True)
            return
        try:
            body = await asyncio.wait_for(self._read(receive), self.read_timeout)
        except _Disconnected:
            return
        except _TooLarge:
            await _refuse(scope, send, 413, self._too_large(None), "body_too_large", close=True)
            return
        except asyncio.TimeoutError:
            message = f"the request body was not received within {self.read_timeout:g} s; send it in full at once"
            await _refuse(scope, send, 408, message, "request_timeout", close=True)
            return
        # A large body is measured off the event loop, so it does not stall other clients' streams.
        problem = await asyncio.to_thread(self._check, body) if len(body) > _CHUNK else self._check(body)
        if problem is not None:
            await _refuse(scope, send, 400, problem, "invalid_body")
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _check(self, body: bytes) -> str | None:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"the request body is not valid UTF-8 (byte {exc.start}); send JSON encoded as UTF-8"
        if _SURROGATE_ESCAPE.search(body) and _lone_surrogate(body):
            return (
                "the request body has a string with a lone UTF-16 surrogate escape (\\ud800-\\udfff not part of a "
                "pair), which is not valid Unicode; send valid Unicode text"
            )
        brackets = body.count(b"[") + body.count(b"{")  # cannot nest deeper than this: skips most bodies
        depth = json_depth(body) if brackets > self.max_json_depth else 0
        if depth > self.max_json_depth:
            return (
                f"the JSON body nests arrays/objects {depth} levels deep; the limit is {self.max_json_depth} "
                "(--max-json-depth)"
            )
        return None

    def _too_large(self, declared: int | None) -> str:
        size = f"{declared} bytes" if declared is not None else f"more than {self.max_body_bytes} bytes"
        return f"the request body is too large ({size}); the limit is {self.max_body_bytes} bytes (--max-body-bytes)"


def _lone_surrogate(body: bytes) -> bool:
    """Whether the JSON ``body`` decodes to a string holding an unpaired surrogate (a pair decodes to one astral
    character, which encodes fine). Invalid JSON is left to the route's parser and its error."""
    try:
        json.dumps(json.loads(body), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    except (ValueError, RecursionError):
        return False
    return False


def _header(scope: Scope, name: bytes) -> str:
    return next((value.decode("latin-1") for key, value in scope["headers"] if key == name), "")


def _content_length(scope: Scope) -> int | None:
    value = _header(scope, b"content-length")
    try:
        return int(value) if value else None
    except ValueError:
        return None  # the HTTP layer refuses such a request before it gets here


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _refuse(scope: Scope, send: Send, status: int, message: str, code: str, close: bool = False) -> None:
    """The error in the shape of the API the path belongs to (Anthropic's on ``/v1/messages``, else OpenAI's)."""
    if str(scope.get("path", "")).startswith(ANTHROPIC_PATHS):
        payload: dict[str, Any] = anthropic_error_body(status, message)
    else:
        payload = error_body(status, message, None, code)
    data = json.dumps(payload).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode("ascii"))]
    if close:  # the rest of the body may still be on its way: this connection cannot carry another request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
