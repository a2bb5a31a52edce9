"""HTTP/1.1 connections with a deadline on request headers: uvicorn's h11 protocol plus one timer.

uvicorn closes a keep-alive connection left idle after a response, but waits forever for a fresh connection's
first byte and for the rest of a request's headers once they have started (a slowloris client holds a socket and
a file descriptor as long as it likes). Here a connection that has not completed a request's headers within
``timeout`` seconds (of connecting, or of its previous response) is closed: with a 408 in OpenAI's error shape
if part of a request had arrived, silently if nothing had. A request whose headers are complete is never touched
here; its body's deadline is ``server.limits.RequestLimits``'s.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from radixserve.server.errors import error_body


def _timeout_response(timeout: float) -> bytes:
    message = f"the request headers were not received within {timeout:g} s"
    body = json.dumps(error_body(408, message, None, "request_timeout")).encode("utf-8")
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def guarded_h11(timeout: float) -> type[H11Protocol]:
    """An ``H11Protocol`` subclass (for ``uvicorn.Config(http=...)``) with a ``timeout``-second header deadline."""
    response = _timeout_response(timeout)

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self._serving():
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start a pipelined request
            if not self._serving():
                self._arm()

        def _serving(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(timeout, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self._serving():
                return
            if self.conn.trailing_data[0]:  # part of a request: tell the client why it is cut off
                self.transport.write(response)
            self.transport.close()

    return GuardedH11Protocol
