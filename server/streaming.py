"""Server-sent events as OpenAI streams them: ``data: <json>\\n\\n`` lines, ended by ``data: [DONE]``."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from radixserve.server.errors import APIError, internal_error

logger = logging.getLogger("radixserve.server")

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def sse_event(kind: str, payload: dict[str, Any]) -> str:
    """A named event (``event:`` line), as the Responses and Messages APIs stream them."""
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def stream_chunk(
    cid: str,
    obj: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    include_usage: bool,
) -> str:
    """One OpenAI stream chunk as an SSE event; with ``include_usage`` every chunk carries ``usage`` (null but on
    the final usage chunk), as OpenAI sends it."""
    payload: dict[str, Any] = {"id": cid, "object": obj, "created": created, "model": model, "choices": choices}
    if include_usage:
        payload["usage"] = usage
    return sse(payload)


def sse_error(exc: BaseException) -> str:
    """An error after the 200 headers went out can only be reported in the stream itself."""
    err = exc if isinstance(exc, APIError) else internal_error(exc)
    return sse(err.body())


def openai_stream_error(exc: BaseException) -> list[str]:
    return [sse_error(exc), DONE]


async def guarded(
    events: AsyncIterator[str], on_error: Callable[[BaseException], list[str]] = openai_stream_error
) -> AsyncIterator[str]:
    """Pass ``events`` through; an exception becomes the API's error event(s) (by default an OpenAI error and
    [DONE])."""
    try:
        async for event in events:
            yield event
    except Exception as exc:  # noqa: BLE001 - never cut a stream without telling the client why
        if not isinstance(exc, APIError):
            logger.exception("streaming response failed")
        for line in on_error(exc):
            yield line
    finally:
        await events.aclose()  # type: ignore[attr-defined]


class SSEResponse(StreamingResponse):
    """A streaming response whose body generator is always closed, even when the client goes away.

    Closing runs the generator's ``finally`` (which aborts its requests in the engine) at once, rather than
    whenever the garbage collector finalizes a generator suspended at a ``yield``.
    """

    def __init__(
        self, events: AsyncIterator[str], on_error: Callable[[BaseException], list[str]] = openai_stream_error
    ) -> None:
        super().__init__(
            guarded(events, on_error),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
