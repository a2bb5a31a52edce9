"""Data parallelism on Ray Serve: N engine replicas and the cache-aware router as Serve deployments.

    radixserve ray-serve --replicas 2 --model <model> [engine flags] [--policy ...]

or from Python::

    from radixserve.server.router.ray_serve import build_app
    serve.run(build_app(EngineConfig(model=...), RoutingConfig(), RayServeConfig(replicas=2)), route_prefix="/")

Layout (``build_app``):
  * ``radixserve-replica-<i>`` (i < N): one deployment per replica, ``num_replicas=1``, each holding one ``Engine``
    in-process and the radixserve FastAPI app over it. The app is not served on a port: the router calls the
    replica's ``request`` method through a deployment handle, and ``server.router.asgi_bridge`` runs the request
    through the app (same routes, validation, errors and SSE bytes as ``radixserve serve``). One deployment per
    replica, rather than one deployment with N replicas, so that the router can pin a request to *the* replica
    whose cache holds its prefix (Serve's own handle routing would choose for it).
  * ``radixserve-router``: the ingress (``serve.ingress``), the same router app as ``radixserve router``
    (``server.router.app``) with a ``RayTransport`` over the N handles instead of an ``HttpTransport`` over URLs.
    The policy object, health checks, retries and /router_info are the same code.
Serve's HTTP proxy exposes the router at ``--host``/``--port``. If a replica's engine dies, its ``check_health``
fails and Serve restarts it; the router's health checks take it out meanwhile (and clear its tree).

Ray is imported by this module only; nothing else in radixserve imports this module at import time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import threading
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayActorError

from radixserve.runtime.config import EngineConfig
from radixserve.server.config import ServerConfig
from radixserve.server.router.app import create_router_app
from radixserve.server.router.asgi_bridge import call_asgi
from radixserve.server.router.config import RayServeConfig, RoutingConfig
from radixserve.server.router.replicas import ReplicaPool
from radixserve.server.router.transport import Headers, ReplicaBroken, ReplicaUnavailable, Transport, Upstream

logger = logging.getLogger("radixserve.router")

APP_NAME = "radixserve"
REPLICA_PREFIX = "radixserve-replica-"
ROUTER_NAME = "radixserve-router"


@serve.deployment(max_ongoing_requests=1024, health_check_period_s=5.0)
class EngineReplica:
    """One engine and the radixserve app over it; requests come from the router through ``request``."""

    def __init__(self, engine_config: dict[str, Any]) -> None:
        from radixserve.runtime.engine import Engine
        from radixserve.server.app import create_app

        self.engine = Engine(EngineConfig(**engine_config))
        self.app = create_app(self.engine, ServerConfig())
        self.state = self.app.state.server

    async def request(self, method: str, path: str, headers: Headers, body: bytes) -> AsyncIterator[Any]:
        """Stream one HTTP request's answer: the status and headers first, then body chunks."""
        async for item in call_asgi(self.app, method, path, headers, body):
            yield item

    async def health(self) -> str | None:
        status, why = self.state.status()
        return None if status == "ready" else f"{status}: {why}"

    async def engine_load(self) -> int:
        return len(self.state.inflight)

    async def server_info(self) -> dict[str, Any]:
        """The engine's ``server_info()`` (queues, KV cache, cache statistics), as /server_info has it."""
        return await asyncio.to_thread(self.engine.server_info)

    def check_health(self) -> None:
        """Serve's own probe: a dead engine makes Serve replace this replica."""
        status, why = self.state.status()
        if status == "dead":
            raise RuntimeError(f"the engine is not running: {why}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


class _RayUpstream(Upstream):
    def __init__(self, stream: Any, head: dict[str, Any]) -> None:
        self._stream = stream
        self._finished = False
        self.status = int(head["status"])
        self.headers = [(str(k), str(v)) for k, v in head["headers"]]

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._stream:
                yield chunk
        except Exception as exc:  # noqa: BLE001 - the replica actor died or the call failed mid-response
            raise ReplicaBroken(f"{type(exc).__name__}: {exc}") from exc
        self._finished = True

    async def aclose(self) -> None:
        if not self._finished:
            self._finished = True
            self._stream.cancel()  # the replica's generator is cancelled: the app sees a disconnect


class RayTransport(Transport):
    """Replicas are Serve deployment handles, named ``replica-<i>``."""

    def __init__(self, handles: dict[str, Any]) -> None:
        self._handles = handles

    async def open(self, replica: str, method: str, path: str, headers: Headers, body: bytes) -> Upstream:
        stream = self._handles[replica].options(stream=True).request.remote(method, path, headers, body)
        try:
            head = await stream.__anext__()
        except StopAsyncIteration:
            raise ReplicaUnavailable("the replica ended the call without a response", dead=False) from None
        except RayActorError as exc:
            raise ReplicaUnavailable(f"replica actor unavailable: {exc}", dead=True) from exc
        except Exception as exc:  # noqa: BLE001 - Serve's own errors (back-pressure, a replica being replaced)
            raise ReplicaUnavailable(f"{type(exc).__name__}: {exc}", dead=False) from exc
        except BaseException:
            stream.cancel()
            raise
        return _RayUpstream(stream, head)

    async def health(self, replica: str, timeout: float) -> str | None:
        response = self._handles[replica].health.remote()
        try:
            return await asyncio.wait_for(response, timeout)
        except TimeoutError:
            response.cancel()
            return f"health check timed out after {timeout} s"
        except Exception as exc:  # noqa: BLE001 - an actor that died, a replica being restarted
            return f"health check failed: {type(exc).__name__}: {exc}"

    async def engine_load(self, replica: str, timeout: float) -> int | None:
        try:
            return int(await asyncio.wait_for(self._handles[replica].engine_load.remote(), timeout))
        except Exception:  # noqa: BLE001 - no load figure this round
            return None


@serve.deployment(max_ongoing_requests=4096)
@serve.ingress()
class RouterIngress:
    """The router app (``server.router.app``) over handles to the replica deployments."""

    def __init__(self, routing: dict[str, Any], api_key: str, *replicas: Any) -> None:
        self._routing = RoutingConfig(**routing)
        ids = [f"replica-{i}" for i in range(len(replicas))]
        self._pool = ReplicaPool(ids, self._routing.make_policy())
        self._transport = RayTransport(dict(zip(ids, replicas)))
        self._server_config = ServerConfig(api_key=api_key)

    def __serve_build_asgi_app__(self) -> Any:
        return create_router_app(self._pool, self._transport, self._server_config, self._routing)


def build_app(engine_config: EngineConfig, routing: RoutingConfig, ray_config: RayServeConfig) -> Any:
    """The Serve application: ``ray_config.replicas`` engine deployments behind the router ingress."""
    actor_options = {"num_cpus": ray_config.num_cpus_per_replica, "num_gpus": ray_config.num_gpus_per_replica}
    replicas = [
        EngineReplica.options(name=f"{REPLICA_PREFIX}{i}", num_replicas=1, ray_actor_options=actor_options).bind(
            dataclasses.asdict(engine_config)
        )
        for i in range(ray_config.replicas)
    ]
    router = RouterIngress.options(name=ROUTER_NAME, ray_actor_options={"num_cpus": ray_config.router_num_cpus})
    return router.bind(dataclasses.asdict(routing), ray_config.api_key, *replicas)


def deploy(engine_config: EngineConfig, routing: RoutingConfig, ray_config: RayServeConfig) -> str:
    """Start Serve (Ray must be initialized) with its HTTP proxy at the configured address, deploy the app, wait
    until every replica is up, and return the router's base URL."""
    serve.start(http_options={"host": ray_config.host, "port": ray_config.port})
    serve.run(build_app(engine_config, routing, ray_config), name=APP_NAME, route_prefix="/")
    return f"http://{ray_config.host}:{ray_config.port}"


def run_ray_serve(engine_config: EngineConfig, routing: RoutingConfig, ray_config: RayServeConfig) -> int:
    """``radixserve ray-serve``: deploy, log the ready line, serve until SIGTERM or Ctrl+C, then tear down."""
    ray.init(address=ray_config.ray_address or None)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        url = deploy(engine_config, routing, ray_config)
        logger.info(
            "radixserve ready: %d replicas of %s behind the %s router at %s (OpenAI API at /v1)",
            ray_config.replicas,
            engine_config.model,
            routing.policy,
            url,
        )
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
