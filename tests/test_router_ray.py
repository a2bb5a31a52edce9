"""Data parallelism on Ray Serve (``server.router.ray_serve``): two engine replicas of a tiny model behind the
cache-aware router ingress, on a local Ray instance with fractional CPUs. Skipped without ``ray[serve]``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from radixserve.runtime.config import EngineConfig  # noqa: E402
from radixserve.server.router.config import RayServeConfig, RoutingConfig  # noqa: E402
from radixserve.server.router.proxy import REPLICA_HEADER  # noqa: E402
from radixserve.server.testing import free_port  # noqa: E402
from tests.test_router import ORDER, _messages  # noqa: E402


@pytest.fixture(scope="module")
def ray_router(tiny_model_dir: Path) -> Iterator[str]:
    from radixserve.server.router.ray_serve import deploy

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        engine = EngineConfig(model=str(tiny_model_dir), device="cpu", max_total_tokens=4096)
        routing = RoutingConfig(health_check_interval=0.5)
        layout = RayServeConfig(replicas=2, num_cpus_per_replica=0.5, router_num_cpus=0.25, port=free_port())
        yield deploy(engine, routing, layout)
    finally:
        serve.shutdown()
        ray.shutdown()


def test_ray_serve_routes_by_prefix(ray_router: str) -> None:
    assert httpx.get(ray_router + "/health", timeout=30).json() == {"status": "ready", "healthy_replicas": 2}
    client = openai.OpenAI(base_url=ray_router + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    served, cached = [], []
    for n, prefix in enumerate(ORDER):
        raw = client.chat.completions.with_raw_response.create(model=model, messages=_messages(prefix, n), max_tokens=2)
        served.append(raw.headers[REPLICA_HEADER])
        cached.append(raw.parse().usage.prompt_tokens_details.cached_tokens)
    for prefix in range(4):  # each prefix stays on one replica, where every repeat hits the cache
        assert len({s for s, p in zip(served, ORDER) if p == prefix}) == 1
        firsts = [i for i, p in enumerate(ORDER) if p == prefix][1:]
        assert all(cached[i] > 150 for i in firsts), cached
    assert set(served) == {"replica-0", "replica-1"}

    chunks = list(client.completions.create(model=model, prompt="hello", max_tokens=5, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    native = httpx.post(ray_router + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}})
    assert native.status_code == 200 and native.json()["meta_info"]["completion_tokens"] == 3
    bad = httpx.post(ray_router + "/v1/chat/completions", json={"model": model, "messages": []})
    assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}

    info = httpx.get(ray_router + "/router_info").json()
    assert info["policy"] == "cache_aware" and all(r["healthy"] and r["in_flight"] == 0 for r in info["replicas"])
    assert info["routing"]["decisions"]["prefix"] >= 12
    flushed = httpx.post(ray_router + "/flush_cache", timeout=60)
    assert flushed.status_code == 200 and flushed.json()["success"]


def test_ray_serve_client_disconnect_aborts_on_the_replica(ray_router: str) -> None:
    body = {"prompt": "hello", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", ray_router + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        replica = resp.headers[REPLICA_HEADER]
        handle = serve.get_deployment_handle(f"radixserve-{replica}", app_name="radixserve")
        aborted = handle.server_info.remote().result()["cache_stats"]["requests_aborted"]
        for n, _ in enumerate(resp.iter_lines()):
            if n >= 6:
                break
    deadline = time.monotonic() + 30
    while True:  # the replica's server saw the disconnect and aborted the request
        info = handle.server_info.remote().result()
        if info["cache_stats"]["requests_aborted"] == aborted + 1 and handle.engine_load.remote().result() == 0:
            break
        assert time.monotonic() < deadline, info
        time.sleep(0.1)
    info = httpx.get(ray_router + "/router_info").json()
    assert all(r["in_flight"] == 0 for r in info["replicas"])
