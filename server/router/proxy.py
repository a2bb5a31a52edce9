"""Forwarding one request: choose a replica, send, retry elsewhere while that is safe, relay the answer.

Retry rule (see ``server.router.transport``): a request goes to another replica when its replica did not answer
with a status line, or answered 503 (not serving: loading, draining, engine dead) or 429 (queue full) while
another candidate remains. A replica that refused the connection or answered 503 is marked unhealthy at once; one
whose connection failed before answering is tried at most twice (the failure may be one stale connection). Each
replica is thus tried a bounded number of times and the loop ends. A request whose connection broke before an
answer on ``MAX_BROKEN_REPLICAS`` different replicas is not sent to a third (a 502): it may be what kills them, and
one poison request must not take down the whole fleet. Once a status line has arrived the request
belongs to that replica: if it then dies, a JSON answer becomes a 502 and a stream gets an error event and
``[DONE]``, both in OpenAI's error shape.

Invariant: every ``pool.acquire`` is matched by exactly one ``pool.release``, however the request ends (success,
failure, client disconnect, cancellation): ``_Lease`` owns that pairing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from radixserve.server.errors import error_body
from radixserve.server.router.replicas import ReplicaPool
from radixserve.server.router.text import routing_text
from radixserve.server.router.transport import Headers, ReplicaBroken, ReplicaUnavailable, Transport, Upstream

logger = logging.getLogger("radixserve.router")

T = TypeVar("T")
RETRY_AFTER_S = 2
REPLICA_HEADER = "x-radixserve-replica"  # on every relayed response: which replica answered
# A Responses id at the start of a response body or stream (the object's first field, the first event's response).
RESPONSE_ID = re.compile(rb'"id":\s*"(resp_[A-Za-z0-9]+)"')
SNIFF_BYTES = 4096
MAX_RESPONSE_HOMES = 100_000  # response id -> the replica whose store holds it, oldest forgotten first
DISCONNECT_POLL_S = 0.25
# Not forwarded in either direction: hop-by-hop headers, and those the HTTP layer recomputes.
_SKIP_HEADERS = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
     "transfer-encoding", "upgrade", "host", "content-length"}
)  # fmt: skip


class ClientGone(Exception):
    """The client disconnected while the router waited for the replica."""


def forwarded_headers(headers: Any) -> Headers:
    """The client's headers minus hop-by-hop ones (Authorization is kept: replicas check the same key) and its
    Origin: CORS is the router's to answer (``_cors_free``)."""
    return [(k, v) for k, v in headers.items() if k.lower() not in _SKIP_HEADERS and k.lower() != "origin"]


def _cors_free(headers: Headers) -> Headers:
    """A replica's response headers without CORS ones: the router's own CORS settings decide (a replica allowing
    every origin must not open a router that names its origins)."""
    return [(k, v) for k, v in headers if not k.lower().startswith("access-control-")]


def error_response(status: int, message: str, code: str, retry_after: bool = False) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if retry_after else None
    return JSONResponse(error_body(status, message, None, code), status_code=status, headers=headers)


class _Lease:
    """One request's hold on a replica's in-flight count; ``release`` is idempotent."""

    def __init__(self, pool: ReplicaPool, replica: str) -> None:
        self.pool, self.replica, self._held = pool, replica, True
        pool.acquire(replica)

    def release(self) -> None:
        if self._held:
            self._held = False
            self.pool.release(self.replica)


class _RelayedStream(StreamingResponse):
    """A replica's stream passed through byte for byte. If the replica dies mid-stream the client gets an error
    event and [DONE]; whatever way the response ends (including a client disconnect, which cancels the body
    iterator, or a response never started) the upstream is closed and the lease released."""

    def __init__(
        self, upstream: Upstream, lease: _Lease, headers: Headers, sniff: Callable[[bytes], bool] | None = None
    ) -> None:
        self._upstream, self._lease, self._sniff = upstream, lease, sniff
        super().__init__(self._relay(), status_code=upstream.status)
        self.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]

    async def _relay(self) -> AsyncIterator[bytes]:
        head = b""
        try:
            async for chunk in self._upstream.chunks():
                if self._sniff is not None:  # the start of the stream, until the sniffer found what it wanted
                    head += chunk
                    if self._sniff(head[:SNIFF_BYTES]) or len(head) >= SNIFF_BYTES:
                        self._sniff = None
                yield chunk
        except ReplicaBroken as exc:
            self._lease.pool.replicas[self._lease.replica].failed += 1
            self._lease.pool.mark_dead(self._lease.replica, f"died mid-stream: {exc}")
            body = error_body(502, f"the replica failed while streaming the response: {exc}", None, "replica_failed")
            yield f"\n\ndata: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()

    async def _close(self) -> None:
        try:
            await asyncio.shield(self._upstream.aclose())
        finally:
            self._lease.release()


async def until_disconnected(request: Request | None, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable``, unless the client disconnects first: then cancel it and raise ``ClientGone``."""
    task = asyncio.ensure_future(awaitable)
    if request is None:
        return await task
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            (result,) = await asyncio.gather(task, return_exceptions=True)
            if isinstance(result, Upstream):  # it completed before the cancel landed: nobody else will close it
                await result.aclose()


class Forwarder:
    """Forwards requests over ``transport`` to the replicas of ``pool``."""

    MAX_TRANSIENT_FAILURES = 2  # per replica and request: connection failures before a status line
    MAX_BROKEN_REPLICAS = 2  # per request: replicas whose connection broke after it was sent

    def __init__(self, pool: ReplicaPool, transport: Transport) -> None:
        self.pool = pool
        self.transport = transport
        # Response id -> the replica that stored it (for previous_response_id); only the event loop touches it.
        self.response_homes: OrderedDict[str, str] = OrderedDict()

    async def generation(self, request: Request, path: str) -> Response:
        """A prompt-carrying POST (chat, completions, /generate, messages, responses): routed by the policy on its
        text. A Responses request continuing a stored response (``previous_response_id``) goes to the replica that
        stored it: the store is per replica."""
        body = await request.body()
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None  # the replica answers it with the proper 400
        text = routing_text(path, parsed)
        if not path.endswith("/responses"):
            return await self.forward(request, "POST", path, body, text)
        previous = parsed.get("previous_response_id") if isinstance(parsed, dict) else None
        prefer = self.response_homes.get(previous) if isinstance(previous, str) else None
        return await self.forward(request, "POST", path, body, text, prefer=prefer, learn=self._learn_home)

    def _learn_home(self, replica: str, head: bytes) -> bool:
        """Note which replica stored the response whose JSON (or first stream event) starts ``head``; True once
        found."""
        found = RESPONSE_ID.search(head)
        if found is None:
            return False
        self.response_homes[found.group(1).decode()] = replica
        self.response_homes.move_to_end(found.group(1).decode())
        while len(self.response_homes) > MAX_RESPONSE_HOMES:
            self.response_homes.popitem(last=False)
        return True

    async def forward(
        self,
        request: Request,
        method: str,
        path: str,
        body: bytes,
        text: str | None,
        *,
        prefer: str | None = None,
        learn: Callable[[str, bytes], bool] | None = None,
    ) -> Response:
        """Send to ``prefer`` while it can take requests, else to the policy's choice (``text`` given) or the least
        loaded replica (``text`` None). ``learn(replica, head)`` sees the start of the response body."""
        headers = forwarded_headers(request.headers)
        excluded: set[str] = set()
        transient: dict[str, int] = {}
        broken: set[str] = set()
        while True:
            if prefer is not None and prefer in self.pool.candidates(excluded):
                replica: str | None = prefer
            elif text is None:
                replica = self.pool.least_loaded(excluded)
            else:
                decision = self.pool.choose(text, excluded)
                replica = decision.replica if decision else None
            if replica is None:
                healthy = self.pool.any_healthy()
                self.pool.no_replica += not healthy
                self.pool.all_refused += healthy
                why = "every replica refused it" if healthy else "all replicas are unhealthy"
                return error_response(503, f"no replica can take the request: {why}", "no_healthy_replica", True)
            lease = _Lease(self.pool, replica)
            try:
                upstream = await until_disconnected(request, self.transport.open(replica, method, path, headers, body))
            except ReplicaUnavailable as exc:
                lease.release()
                self.pool.replicas[replica].retried_elsewhere += 1
                transient[replica] = transient.get(replica, 0) + 1
                if exc.dead:
                    self.pool.mark_dead(replica, str(exc))
                if exc.dead or transient[replica] >= self.MAX_TRANSIENT_FAILURES:
                    excluded.add(replica)
                if not exc.dead:
                    broken.add(replica)
                    if len(broken) >= self.MAX_BROKEN_REPLICAS:
                        logger.warning("request to %s broke the connection to replicas %s; not retried", path, broken)
                        why = f"the connection to {len(broken)} replicas broke while they had this request"
                        return error_response(502, f"{why}; it is not sent to more", "replica_failed")
                logger.info("replica %s did not take the request (%s); trying another", replica, exc)
                continue
            except BaseException:  # ClientGone, cancellation: nothing to relay
                lease.release()
                raise
            if upstream.status in (429, 503) and self.pool.candidates(excluded | {replica}):
                await self._discard(upstream, lease)
                self.pool.replicas[replica].retried_elsewhere += 1
                if upstream.status == 503:
                    self.pool.mark_dead(replica, "answered 503 (not serving)")
                excluded.add(replica)
                continue
            return await self._relay(request, upstream, lease, learn)

    async def _discard(self, upstream: Upstream, lease: _Lease) -> None:
        try:
            await upstream.aclose()
        finally:
            lease.release()

    async def _relay(
        self, request: Request, upstream: Upstream, lease: _Lease, learn: Callable[[str, bytes], bool] | None = None
    ) -> Response:
        # The router's own server adds Date and Server: the replica's would repeat them.
        skip = _SKIP_HEADERS | {"date", "server"}
        headers = [(k, v) for k, v in _cors_free(upstream.headers) if k.lower() not in skip]
        headers.append((REPLICA_HEADER, lease.replica))
        if upstream.content_type.startswith("text/event-stream"):
            sniff = (lambda head: learn(lease.replica, head)) if learn is not None and upstream.status == 200 else None
            return _RelayedStream(upstream, lease, headers, sniff)
        try:
            content = await until_disconnected(request, upstream.read())
        except ReplicaBroken as exc:
            self.pool.replicas[lease.replica].failed += 1
            self.pool.mark_dead(lease.replica, f"died mid-response: {exc}")
            return error_response(502, f"the replica failed while sending the response: {exc}", "replica_failed")
        finally:
            await self._discard(upstream, lease)
        if learn is not None and upstream.status == 200:
            learn(lease.replica, content[:SNIFF_BYTES])
        response = Response(content, status_code=upstream.status)
        for k, v in headers:
            response.headers.append(k, v)
        return response
