"""FastAPI dependencies: the shared ``ServerState`` and the API key check."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from radixserve.server.errors import APIError
from radixserve.server.state import ServerState

_bearer = HTTPBearer(auto_error=False, description="The server's --api-key, if it was started with one.")


def get_state(request: Request) -> ServerState:
    return request.app.state.server


def require_api_key(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """401 unless the request carries ``Authorization: Bearer <api key>`` or ``x-api-key: <api key>`` (when the
    server has a key).

    Compared in constant time, so response timing does not reveal how much of a guessed key was right.
    """
    key = get_state(request).config.api_key
    if not key:
        return
    if credentials is None and request.headers.get("x-api-key") is not None:  # Anthropic's clients send this
        given = request.headers["x-api-key"]
        if not hmac.compare_digest(given.encode("utf-8"), key.encode("utf-8")):
            raise APIError(401, "invalid API key", code="invalid_api_key")
        return
    if credentials is None:
        raise APIError(
            401,
            "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    if not hmac.compare_digest(credentials.credentials.encode("utf-8"), key.encode("utf-8")):
        raise APIError(401, "invalid API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def require_metrics_key(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """As ``require_api_key``, for /metrics, only with ``--protect-metrics`` (a Prometheus scrape needs no key
    by default, as with vLLM)."""
    if get_state(request).config.protect_metrics:
        require_api_key(request, credentials)


# ``state: StateDep`` in a route signature injects the shared state (an Annotated alias keeps ruff's B008 quiet).
StateDep = Annotated[ServerState, Depends(get_state)]
