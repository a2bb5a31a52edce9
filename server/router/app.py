"""The router's FastAPI app: OpenAI and native routes proxied to replicas, plus its own /health and /router_info.

``create_router_app(pool, transport, server_config, routing)`` works over any ``Transport``: ``radixserve router``
passes an ``HttpTransport`` over replica URLs (``run_router``), the Ray Serve ingress one over deployment handles.

Routes:
  * POST /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/score, /v1/rerank, /v1/classify, /generate,
    /v1/messages, /v1/responses: routed by the policy on the request's text, streamed through when the replica streams
    (``server.router.proxy``); a Responses request with ``previous_response_id`` goes to the replica that stored
    that response;
  * GET / DELETE /v1/responses/{id} (with its query: a background response streamed again), its /input_items, and
    POST /v1/responses/{id}/cancel: to the replica that stored (or runs) that response;
  * GET /v1/models, /v1/models/{model}, /server_info, POST /tokenize and /detokenize: from the least loaded
    healthy replica (every replica serves the same model; /server_info is that replica's own engine and cache);
  * POST /flush_cache: sent to every healthy replica; 200 only if every one flushed;
  * POST /abort_request: sent to every healthy replica; 200 naming those that ran the rid, else 404;
  * POST /v1/load_lora_adapter, /v1/unload_lora_adapter: sent to every healthy replica; the first failure's
    answer, else 200;
  * GET / HEAD /health: 200 while at least one replica is healthy, else 503 (no API key needed);
  * GET /metrics: Prometheus metrics of routing decisions, replica health and in-flight requests (no API key
    needed unless --protect-metrics);
  * GET /router_info: per replica health, load, tree size and counters, and the policy's routing statistics.
A background task checks every replica's health every ``--health-check-interval`` seconds: a failed check takes
a replica out of rotation (and clears its tree), a passed one brings it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from radixserve.server.config import ServerConfig
from radixserve.server.deps import require_api_key, require_metrics_key
from radixserve.server.errors import install_error_handlers
from radixserve.server.http_compat import install_http_compat
from radixserve.server.limits import RequestLimits
from radixserve.server.router.config import RoutingConfig
from radixserve.server.router.metrics import render, router_registry
from radixserve.server.router.proxy import ClientGone, Forwarder, error_response
from radixserve.server.router.replicas import ReplicaPool
from radixserve.server.router.transport import Transport

logger = logging.getLogger("radixserve.router")

CLIENT_CLOSED = 499
FLUSH_TIMEOUT_S = 60.0
LORA_TIMEOUT_S = 120.0  # a replica reads the adapter from its disk


class RouterState:
    """What the routes share. Named and shaped like ``server.state.ServerState`` where the serving helpers
    (``server.testing.ServerThread``, ``server.app.attach_server``, ``require_api_key``) look: ``config``,
    ``listen_url``, ``exit_requested``."""

    def __init__(self, pool: ReplicaPool, transport: Transport, config: ServerConfig, routing: RoutingConfig) -> None:
        self.pool = pool
        self.transport = transport
        self.config = config
        self.routing = routing
        self.forwarder = Forwarder(pool, transport)
        self.listen_url: Any = None
        self.exit_requested: Any = None
        self.health_checks = 0
        self.registry = router_registry(pool)

    async def check_replicas(self) -> None:
        """One round of health checks (and load refreshes), all replicas concurrently."""
        timeout = self.routing.health_check_timeout

        async def check(rid: str) -> None:
            try:
                why = await asyncio.wait_for(self.transport.health(rid, timeout), timeout + 1.0)
            except TimeoutError:
                why = f"health check timed out after {timeout} s"
            if why is None:
                self.pool.mark_alive(rid)
                if self.routing.load_from_server_info:
                    load = await self.transport.engine_load(rid, timeout)
                    if load is not None:
                        self.pool.set_engine_load(rid, load)
            else:
                self.pool.mark_dead(rid, why)

        await asyncio.gather(*(check(rid) for rid in self.pool.replicas))
        self.health_checks += 1

    async def health_loop(self) -> None:
        while True:
            try:
                await self.check_replicas()
            except Exception:  # noqa: BLE001 - the loop must survive anything a replica answers
                logger.exception("health check round failed")
            await asyncio.sleep(self.routing.health_check_interval)


def _state(request: Request) -> RouterState:
    return request.app.state.router


async def _routed(request: Request, path: str) -> Response:
    try:
        return await _state(request).forwarder.generation(request, path)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)


def _scored(path: str) -> Callable[[Request], Awaitable[Response]]:
    async def route(request: Request) -> Response:
        return await _routed(request, path)

    return route


def _build_routes() -> tuple[APIRouter, APIRouter]:
    api = APIRouter(dependencies=[Depends(require_api_key)], tags=["Router"])
    open_routes = APIRouter(tags=["Router"])

    @api.post("/v1/chat/completions", summary="Chat completion, proxied to the chosen replica")
    async def chat(request: Request) -> Response:
        return await _routed(request, "/v1/chat/completions")

    @api.post("/v1/completions", summary="Text completion, proxied to the chosen replica")
    async def completions(request: Request) -> Response:
        return await _routed(request, "/v1/completions")

    @api.post("/v1/embeddings", summary="Embeddings, proxied to the chosen replica")
    async def embeddings(request: Request) -> Response:
        return await _routed(request, "/v1/embeddings")

    for path in ("/v1/score", "/score", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/classify", "/classify"):
        api.add_api_route(path, _scored(path), methods=["POST"], include_in_schema=path.startswith("/v1/"),
                          summary="Scores and classes (a pooling model's), proxied to the chosen replica")  # fmt: skip

    @api.post("/v1/responses", summary="Responses API, proxied to the chosen replica (or the one storing the thread)")
    async def responses(request: Request) -> Response:
        return await _routed(request, "/v1/responses")

    @api.post("/v1/messages", summary="Anthropic Messages API, proxied to the chosen replica")
    async def messages(request: Request) -> Response:
        return await _routed(request, "/v1/messages")

    @api.post("/generate", summary="Native generation, proxied to the chosen replica")
    async def generate(request: Request) -> Response:
        return await _routed(request, "/generate")

    async def _one(request: Request, method: str, path: str) -> Response:
        """To the least loaded healthy replica (every replica serves the same model and tokenizer)."""
        body = await request.body() if method == "POST" else b""
        try:
            return await _state(request).forwarder.forward(request, method, path, body, None)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)

    async def _stored(request: Request, method: str, response_id: str, suffix: str = "") -> Response:
        """A stored response lives on the replica that made it: there, when the router saw it made. The query
        goes along (a background response streamed again: ``?stream=true&starting_after=N``)."""
        forwarder = _state(request).forwarder
        path = f"/v1/responses/{quote(response_id, safe='')}{suffix}"
        if request.url.query:
            path += f"?{request.url.query}"
        home = forwarder.response_homes.get(response_id)
        try:
            return await forwarder.forward(request, method, path, b"", None, prefer=home)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)

    @api.get("/v1/responses/{response_id}", summary="A stored response, from the replica that stored it")
    async def get_response(request: Request, response_id: str) -> Response:
        return await _stored(request, "GET", response_id)

    @api.post("/v1/responses/{response_id}/cancel", summary="Cancel a background response, on the replica running it")
    async def cancel_response(request: Request, response_id: str) -> Response:
        return await _stored(request, "POST", response_id, "/cancel")

    @api.delete("/v1/responses/{response_id}", summary="Delete a stored response, on the replica that stored it")
    async def delete_response(request: Request, response_id: str) -> Response:
        return await _stored(request, "DELETE", response_id)

    @api.get("/v1/responses/{response_id}/input_items", summary="A stored response's input items")
    async def response_items(request: Request, response_id: str) -> Response:
        return await _stored(request, "GET", response_id, "/input_items")

    @api.get("/v1/models", summary="The served models, from one healthy replica")
    async def models(request: Request) -> Response:
        return await _one(request, "GET", "/v1/models")

    @api.get("/v1/models/{model:path}", summary="One served model, from one healthy replica")
    async def model(request: Request, model: str) -> Response:
        return await _one(request, "GET", f"/v1/models/{quote(model, safe='')}")  # one segment, never a path

    @api.post("/tokenize", summary="Tokenize (or render a chat), on one healthy replica")
    async def tokenize(request: Request) -> Response:
        return await _one(request, "POST", "/tokenize")

    @api.post("/detokenize", summary="The text of token ids, on one healthy replica")
    async def detokenize(request: Request) -> Response:
        return await _one(request, "POST", "/detokenize")

    @api.get("/server_info", summary="One healthy replica's engine state (each replica has its own cache)")
    async def server_info(request: Request) -> Response:
        return await _one(request, "GET", "/server_info")

    @api.post("/abort_request", summary="Abort a request on whichever replica runs it")
    async def abort_request(request: Request) -> JSONResponse:
        state = _state(request)
        body = await request.body()
        targets = list(state.pool.candidates())
        answers = await asyncio.gather(
            *(state.transport.call(rid, "POST", "/abort_request", FLUSH_TIMEOUT_S, body) for rid in targets)
        )
        found = [rid for rid, (status, _) in zip(targets, answers) if status == 200]
        if found:
            return JSONResponse({"success": True, "replicas": found})
        client_errors = [answer for status, answer in answers if status == 400]
        if client_errors:  # a malformed body: every replica says so alike
            return JSONResponse(client_errors[0], status_code=400)
        message = "no replica runs a request with that rid" if targets else "no healthy replica"
        code = "request_not_found" if targets else "no_healthy_replica"
        return error_response(404 if targets else 503, message, code)

    @api.post("/flush_cache", summary="Flush every healthy replica's prefix cache")
    async def flush_cache(request: Request) -> JSONResponse:
        state = _state(request)
        targets = list(state.pool.candidates())
        if not targets:
            return error_response(503, "no replica can flush its cache: none is healthy", "no_healthy_replica")
        answers = await asyncio.gather(
            *(state.transport.call(rid, "POST", "/flush_cache", FLUSH_TIMEOUT_S) for rid in targets)
        )
        results = {rid: {"status": status, "body": body} for rid, (status, body) in zip(targets, answers)}
        ok = all(status == 200 for status, _ in answers)
        if ok:
            status = 200
        elif any(s == 400 for s, _ in answers):
            status = 400  # a replica had requests running: retry when idle, as with one server
        else:
            status = 502
        return JSONResponse({"success": ok, "replicas": results}, status_code=status)

    @api.post("/v1/load_lora_adapter", summary="Load a LoRA adapter on every healthy replica")
    @api.post("/load_lora_adapter", include_in_schema=False)
    async def load_lora_adapter(request: Request) -> Response:
        return await _everywhere(request, "/v1/load_lora_adapter")

    @api.post("/v1/unload_lora_adapter", summary="Unload a LoRA adapter on every healthy replica")
    @api.post("/unload_lora_adapter", include_in_schema=False)
    async def unload_lora_adapter(request: Request) -> Response:
        return await _everywhere(request, "/v1/unload_lora_adapter")

    async def _everywhere(request: Request, path: str) -> Response:
        """Every replica serves the same adapters: the call goes to each healthy one; the answer is the first
        failure's (a 4xx in the API's shape, with each replica's status under ``replicas``: a retry finds the
        adapter already loaded where it succeeded) or, when all succeed, the first answer."""
        state = _state(request)
        targets = list(state.pool.candidates())
        if not targets:
            return error_response(503, f"no healthy replica to send {path} to", "no_healthy_replica")
        body = await request.body()
        answers = await asyncio.gather(*(state.transport.call(r, "POST", path, LORA_TIMEOUT_S, body) for r in targets))
        failed = [(r, status, answer) for r, (status, answer) in zip(targets, answers) if status != 200]
        if not failed:
            return Response(str(answers[0][1]), media_type="text/plain")
        replica, status, answer = failed[0]
        statuses = {r: code for r, (code, _) in zip(targets, answers, strict=True)}
        if status == 0:
            response = error_response(502, f"replica {replica} did not answer {path}: {answer}", "replica_failed")
            answer, status = json.loads(response.body), 502
        if not isinstance(answer, dict):
            answer = {"error": {"message": str(answer), "type": "api_error", "param": None, "code": status}}
        return JSONResponse({**answer, "replicas": statuses}, status_code=status)

    @api.get("/router_info", summary="Replicas' health and load, and routing statistics")
    async def router_info(request: Request) -> dict[str, Any]:
        state = _state(request)
        return {**state.pool.info(), "health_checks": state.health_checks}

    @open_routes.get(
        "/metrics",
        summary="Prometheus metrics of the router (open unless --protect-metrics)",
        response_class=Response,
        dependencies=[Depends(require_metrics_key)],
    )
    async def metrics(request: Request) -> Response:
        return Response(render(_state(request).registry), media_type=CONTENT_TYPE_LATEST)

    @open_routes.get("/health", summary="200 while at least one replica is healthy")  # HEAD too (http_compat)
    async def health(request: Request) -> JSONResponse:
        pool = _state(request).pool
        healthy = sum(r.healthy for r in pool.replicas.values())
        body = {"status": "ready" if healthy else "unavailable", "healthy_replicas": healthy}
        return JSONResponse(body, status_code=200 if healthy else 503)

    return api, open_routes


def create_router_app(
    pool: ReplicaPool, transport: Transport, server_config: ServerConfig, routing: RoutingConfig
) -> FastAPI:
    """The router app over ``pool`` (its policy included) and ``transport``. Its lifespan runs the health loop
    (the first round before it serves) and closes the transport when it stops."""
    state = RouterState(pool, transport, server_config, routing)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.check_replicas()
        checker = asyncio.ensure_future(state.health_loop())
        try:
            yield
        finally:
            checker.cancel()
            await asyncio.gather(checker, return_exceptions=True)
            await transport.aclose()

    app = FastAPI(
        title="radixserve router",
        summary="Data-parallel front for radixserve replicas, with cache-aware routing.",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.router = state
    app.state.server = state  # where require_api_key and the serving helpers look
    install_error_handlers(app)
    app.add_middleware(
        RequestLimits,
        max_body_bytes=server_config.max_body_bytes,
        max_json_depth=server_config.max_json_depth,
        read_timeout=server_config.request_read_timeout,
    )
    install_http_compat(app, server_config)
    api, open_routes = _build_routes()
    app.include_router(open_routes)
    app.include_router(api)
    return app
