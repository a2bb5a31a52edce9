"""A request id for every HTTP request: the client's ``X-Request-Id`` or a new one, sent back in that header,
and attached to every log line written while the request is served (``--log-format json`` prints it)."""

from __future__ import annotations

import re
import uuid
from typing import Any

from radixserve.runtime.logs import current_request_id
from radixserve.server.asgi import HttpMiddleware

HEADER = b"x-request-id"
# A client's id is kept if it is short and plain (it ends up in logs and headers); otherwise a new one is made.
_CLIENT_ID = re.compile(rb"^[A-Za-z0-9._:-]{1,128}$")


class RequestIdMiddleware(HttpMiddleware):
    """Sets ``current_request_id`` and the response header."""

    async def http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        sent = dict(scope.get("headers") or []).get(HEADER)
        rid = sent.decode() if sent is not None and _CLIENT_ID.match(sent) else uuid.uuid4().hex
        current_request_id.set(rid)

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, rid.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)
