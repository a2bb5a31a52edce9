"""How the router reaches a replica: the ``Transport`` interface, and ``HttpTransport`` (httpx, replica URLs).

A transport turns failures into two exceptions whose difference is the router's retry rule:
  * ``ReplicaUnavailable``: the replica did not answer with a status line (connection refused or timed out, or the
    connection failed before any response). Nothing reached the client and generation has no side effects, so
    the router may send the request to another replica. ``dead`` says whether the replica itself looks gone
    (it refused a connection) rather than one connection having failed.
  * ``ReplicaBroken``: the replica failed after its status line (it died mid-response). The request belongs to
    that replica and is failed: a 502 for a JSON response, an error event for a stream already under way.
``Upstream.aclose`` releases the replica's side: for a stream not read to its end it drops the connection, which
the replica sees as a client disconnect (it aborts the request and frees its KV).
"""

from __future__ import annotations

import asyncio
import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

import httpx

Headers = list[tuple[str, str]]


class ReplicaUnavailable(Exception):
    """The replica did not take the request; another may. See the module docstring."""

    def __init__(self, message: str, *, dead: bool) -> None:
        super().__init__(message)
        self.dead = dead


class ReplicaBroken(Exception):
    """The replica failed after it started answering."""


class Upstream(ABC):
    """A replica's response whose status and headers have arrived; the body is still to read."""

    status: int
    headers: Headers

    @property
    def content_type(self) -> str:
        return next((v for k, v in self.headers if k.lower() == "content-type"), "")

    @abstractmethod
    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; raises ``ReplicaBroken`` if the replica fails before its end."""

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    @abstractmethod
    async def aclose(self) -> None:
        """Release the response (idempotent); an unfinished one is cancelled at the replica."""


class Transport(ABC):
    """Sends requests to replicas named by id (a URL for HTTP, a replica name for Ray)."""

    @abstractmethod
    async def open(self, replica: str, method: str, path: str, headers: Headers, body: bytes) -> Upstream:
        """Send a request; return once its status line is in. Raises ``ReplicaUnavailable``."""

    @abstractmethod
    async def health(self, replica: str, timeout: float) -> str | None:
        """None if the replica is ready to serve, else why not."""

    async def engine_load(self, replica: str, timeout: float) -> int | None:
        """Requests the replica's engine is running or holding in its queue, if it can tell."""
        return None

    def own_headers(self) -> Headers:
        """Headers of the router's own calls (its API key for the replicas)."""
        return []

    async def call(self, replica: str, method: str, path: str, timeout: float, body: bytes = b"") -> tuple[int, Any]:
        """The router's own request (e.g. /flush_cache; ``body`` is JSON): (status, parsed JSON or text), or
        (0, why) if it failed."""
        headers = self.own_headers() + ([("content-type", "application/json")] if body else [])
        try:
            upstream = await asyncio.wait_for(self.open(replica, method, path, headers, body), timeout)
            try:
                raw = await asyncio.wait_for(upstream.read(), timeout)
            finally:
                await upstream.aclose()
        except (ReplicaUnavailable, ReplicaBroken, TimeoutError) as exc:
            return 0, f"{type(exc).__name__}: {exc}"
        try:
            return upstream.status, json.loads(raw)
        except ValueError:
            return upstream.status, raw.decode("utf-8", errors="replace")

    async def aclose(self) -> None:
        """Release connections (the router is stopping). Nothing to release by default."""
        return None


class _HttpUpstream(Upstream):
    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code
        self.headers = [(k, v) for k, v in response.headers.multi_items()]

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_raw():  # raw: a content-encoding passes through untouched
                yield chunk
        except httpx.TransportError as exc:
            raise ReplicaBroken(f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        await self._response.aclose()


class HttpTransport(Transport):
    """Replicas are base URLs; one pooled ``httpx.AsyncClient`` reaches them all.

    ``own_key`` is sent as a bearer token on the router's own calls (/server_info); a forwarded request carries
    its client's Authorization header instead. Reads have no timeout (a long generation is not a failure);
    connecting has ``connect_timeout``.
    """

    KEEPALIVE_S = 2.0  # below uvicorn's 5 s keep-alive, so a pooled connection is not closed under a request

    def __init__(self, connect_timeout: float = 5.0, own_key: str = "") -> None:
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=self.KEEPALIVE_S),
        )
        self._own_headers = {"Authorization": f"Bearer {own_key}"} if own_key else {}

    async def open(self, replica: str, method: str, path: str, headers: Headers, body: bytes) -> Upstream:
        request = self._client.build_request(method, replica + path, headers=headers, content=body)
        try:
            response = await self._client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise ReplicaUnavailable(f"cannot connect: {type(exc).__name__}: {exc}", dead=True) from exc
        except httpx.TransportError as exc:
            raise ReplicaUnavailable(f"no response: {type(exc).__name__}: {exc}", dead=False) from exc
        return _HttpUpstream(response)

    async def health(self, replica: str, timeout: float) -> str | None:
        try:
            response = await self._client.get(replica + "/health", timeout=timeout)
        except httpx.TransportError as exc:
            return f"health check failed: {type(exc).__name__}: {exc}"
        if response.status_code != 200:
            return f"health check answered HTTP {response.status_code}"
        return None

    async def engine_load(self, replica: str, timeout: float) -> int | None:
        try:
            response = await self._client.get(replica + "/server_info", headers=self._own_headers, timeout=timeout)
            info = response.json() if response.status_code == 200 else {}
            return int(info["num_running_requests"]) + int(info["num_waiting_requests"])
        except (httpx.TransportError, ValueError, KeyError, TypeError):
            return None

    def own_headers(self) -> Headers:
        return list(self._own_headers.items())

    async def aclose(self) -> None:
        await self._client.aclose()
