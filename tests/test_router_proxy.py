"""The router's proxy rules over a fake transport (fast, no model): retries, the bound on replicas a request may
break, 503 when no replica is healthy, failures mid-response, API keys, the routes sent to one replica or to all,
worker URL checks."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from radixserve.server.router.app import create_router_app
from radixserve.server.router.config import RouterConfig, RoutingConfig
from radixserve.server.router.policy import make_policy
from radixserve.server.router.proxy import REPLICA_HEADER
from radixserve.server.router.replicas import ReplicaPool
from radixserve.server.router.transport import Headers, ReplicaBroken, ReplicaUnavailable, Transport, Upstream

# --- the proxy over a fake transport -------------------------------------------------------------------------


class FakeUpstream(Upstream):
    def __init__(self, status: int, body: list[bytes | Exception], content_type: str = "application/json") -> None:
        self.status = status
        self.headers = [("content-type", content_type)]
        self._body = body
        self.closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        for part in self._body:
            if isinstance(part, Exception):
                raise ReplicaBroken(str(part))
            yield part

    async def aclose(self) -> None:
        self.closed = True


Behaviour = Callable[[str, Headers], "FakeUpstream | Exception"]


def ok_json(payload: dict[str, Any] | None = None) -> Behaviour:
    return lambda path, headers: FakeUpstream(200, [json.dumps(payload or {"ok": True}).encode()])


class FakeTransport(Transport):
    def __init__(self, behaviours: dict[str, Behaviour], unhealthy: dict[str, str] | None = None) -> None:
        self.behaviours = behaviours
        self.unhealthy = unhealthy or {}
        self.calls: list[tuple[str, str, dict[str, str]]] = []

    async def open(self, replica: str, method: str, path: str, headers: Headers, body: bytes) -> Upstream:
        self.calls.append((replica, path, {k.lower(): v for k, v in headers}))
        result = self.behaviours[replica](path, headers)
        if isinstance(result, Exception):
            raise result
        return result

    async def health(self, replica: str, timeout: float) -> str | None:
        return self.unhealthy.get(replica)


def fake_router(transport: FakeTransport, policy: str = "round_robin", api_key: str = "") -> TestClient:
    routing = RoutingConfig(policy=policy, health_check_interval=60.0)
    pool = ReplicaPool(list(transport.behaviours), make_policy(policy))
    config = RouterConfig(worker_urls=("http://unused",), api_key=api_key).server_config()
    return TestClient(create_router_app(pool, transport, config, routing))


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _info(client: TestClient) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in client.get("/router_info").json()["replicas"]}


def _assert_openai_error(body: dict[str, Any], code: str) -> None:
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == code, body


def test_connect_error_is_retried_on_another_replica() -> None:
    down = ReplicaUnavailable("cannot connect", dead=True)
    transport = FakeTransport({"a": lambda p, h: down, "b": ok_json()})
    with fake_router(transport) as client:
        resp = client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 200 and resp.json() == {"ok": True}
        assert resp.headers[REPLICA_HEADER] == "b"
        info = _info(client)
        assert not info["a"]["healthy"] and info["a"]["retried_elsewhere"] == 1 and info["b"]["healthy"]
        assert all(r["in_flight"] == 0 for r in info.values())
        resp = client.post("/v1/chat/completions", json=CHAT)  # a is out of rotation: straight to b
        assert resp.status_code == 200 and [c[0] for c in transport.calls] == ["a", "b", "b"]


def test_transient_failure_retries_the_same_replica_once() -> None:
    attempts: list[int] = []

    def flaky(path: str, headers: Headers) -> FakeUpstream | Exception:
        attempts.append(1)
        if len(attempts) == 1:
            return ReplicaUnavailable("server disconnected without a response", dead=False)
        return FakeUpstream(200, [b"{}"])

    with fake_router(FakeTransport({"a": flaky})) as client:
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
        assert len(attempts) == 2 and _info(client)["a"]["healthy"]


def test_no_healthy_replica_is_503_with_retry_after() -> None:
    transport = FakeTransport({"a": ok_json(), "b": ok_json()}, unhealthy={"a": "down", "b": "down"})
    with fake_router(transport) as client:
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["healthy_replicas"] == 0
        resp = client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 503 and int(resp.headers["Retry-After"]) > 0
        _assert_openai_error(resp.json(), "no_healthy_replica")
        assert client.get("/router_info").json()["requests_refused_no_replica"] == 1
        assert transport.calls == []


def test_replica_answering_503_is_skipped() -> None:
    draining = lambda p, h: FakeUpstream(503, [b'{"error": {"message": "draining"}}'])  # noqa: E731
    with fake_router(FakeTransport({"a": draining, "b": ok_json()})) as client:
        resp = client.post("/generate", json={"text": "hello"})
        assert resp.status_code == 200 and resp.headers[REPLICA_HEADER] == "b"
        assert not _info(client)["a"]["healthy"]


def test_only_replica_answering_429_is_relayed() -> None:
    full = lambda p, h: FakeUpstream(429, [b'{"error": {"message": "queue full"}}'])  # noqa: E731
    with fake_router(FakeTransport({"a": full})) as client:
        resp = client.post("/v1/completions", json={"prompt": "x"})
        assert resp.status_code == 429 and _info(client)["a"]["healthy"]


def test_replica_dying_mid_response_is_a_502() -> None:
    broken = lambda p, h: FakeUpstream(200, [b'{"partial', RuntimeError("reset")])  # noqa: E731
    with fake_router(FakeTransport({"a": broken, "b": ok_json()})) as client:
        resp = client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 502
        _assert_openai_error(resp.json(), "replica_failed")
        info = _info(client)
        assert not info["a"]["healthy"] and info["a"]["requests_failed"] == 1 and info["a"]["in_flight"] == 0


def test_replica_dying_mid_stream_ends_the_stream_with_an_error_event() -> None:
    first = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
    broken = lambda p, h: FakeUpstream(200, [first, RuntimeError("reset")], "text/event-stream")  # noqa: E731
    with fake_router(FakeTransport({"a": broken})) as client:
        resp = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert json.loads(events[0])["choices"][0]["delta"]["content"] == "hi"
        _assert_openai_error(json.loads(events[1]), "replica_failed")
        assert events[-1] == "[DONE]"
        info = _info(client)["a"]
        assert not info["healthy"] and info["in_flight"] == 0


def test_api_key_is_checked_and_forwarded() -> None:
    transport = FakeTransport({"a": ok_json()})
    with fake_router(transport, api_key="sekret") as client:
        assert client.get("/health").status_code == 200  # no key needed
        resp = client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 401
        _assert_openai_error(resp.json(), "invalid_api_key")
        assert client.get("/router_info").status_code == 401
        resp = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer sekret"})
        assert resp.status_code == 200
        assert transport.calls[-1][2]["authorization"] == "Bearer sekret"
        assert "host" not in transport.calls[-1][2]


def test_flush_cache_fans_out() -> None:
    busy = lambda p, h: FakeUpstream(400, [b'{"error": {"code": "cache_in_use"}}'])  # noqa: E731
    with fake_router(FakeTransport({"a": ok_json({"success": True}), "b": ok_json({"success": True})})) as client:
        resp = client.post("/flush_cache")
        assert resp.status_code == 200 and resp.json()["success"] and set(resp.json()["replicas"]) == {"a", "b"}
    with fake_router(FakeTransport({"a": ok_json({"success": True}), "b": busy})) as client:
        resp = client.post("/flush_cache")
        assert resp.status_code == 400 and not resp.json()["success"]
        assert resp.json()["replicas"]["b"]["status"] == 400


def test_lora_adapters_are_loaded_and_unloaded_on_every_replica() -> None:
    loaded = lambda p, h: FakeUpstream(200, [b"Success: LoRA adapter 'x' added successfully."], "text/plain")  # noqa: E731
    refused = lambda p, h: FakeUpstream(400, [b'{"error": {"message": "no", "param": "lora_path"}}'])  # noqa: E731
    transport = FakeTransport({"a": loaded, "b": loaded})
    with fake_router(transport) as client:
        resp = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/a"})
        assert resp.status_code == 200 and resp.text.startswith("Success")
        assert sorted((c[0], c[1]) for c in transport.calls) == [("a", "/v1/load_lora_adapter"),
                                                                 ("b", "/v1/load_lora_adapter")]  # fmt: skip
        assert client.post("/unload_lora_adapter", json={"lora_name": "x"}).status_code == 200  # (SGLang's path)
    with fake_router(FakeTransport({"a": loaded, "b": refused})) as client:
        resp = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/a"})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "lora_path"
        assert resp.json()["replicas"] == {"a": 200, "b": 400}  # where it did load, a retry finds it loaded


def test_a_request_that_breaks_two_replicas_is_not_sent_to_a_third() -> None:
    """A request that kills its replica (a poison input) was retried on every replica in turn."""
    crash = lambda p, h: ReplicaUnavailable("server disconnected without a response", dead=False)  # noqa: E731
    transport = FakeTransport({"a": crash, "b": crash, "c": ok_json()})
    with fake_router(transport) as client:
        resp = client.post("/v1/chat/completions", json=CHAT)
        assert resp.status_code == 502 and "not sent to more" in resp.json()["error"]["message"]
        _assert_openai_error(resp.json(), "replica_failed")
        assert {c[0] for c in transport.calls} == {"a", "b"}


def test_routes_the_dsl_and_clients_need_reach_a_replica() -> None:
    """/tokenize and /server_info (the DSL's select, roles, cache_stats), /v1/models/{id}, /abort_request and
    HEAD /health answered 404/405 through the router."""
    def missing(path: str, headers: Headers) -> FakeUpstream:  # b serves, but does not run request r1
        if path == "/abort_request":
            return FakeUpstream(404, [b'{"error": {"code": "request_not_found"}}'])
        return FakeUpstream(200, [b"{}"])

    transport = FakeTransport({"a": ok_json({"from": "a"}), "b": missing})
    with fake_router(transport, policy="round_robin") as client:
        routes = (("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/server_info"), ("GET", "/v1/models/tiny"))
        for method, path in routes:
            resp = client.request(method, path, json={"prompt": "x"} if method == "POST" else None)
            assert resp.status_code == 200, (path, resp.text)
        assert {path for _, path, _ in transport.calls} == {path for _, path in routes}
        client.get("/v1/models/a%3Fx%3D1")  # one path segment, sent as one (not a query string)
        assert transport.calls[-1][1] == "/v1/models/a%3Fx%3D1"
        resp = client.post("/abort_request", json={"rid": "r1"})
        assert resp.status_code == 200 and resp.json() == {"success": True, "replicas": ["a"]}
        assert client.head("/health").status_code == 200
    with fake_router(FakeTransport({"b": missing})) as client:
        resp = client.post("/abort_request", json={"rid": "r1"})
        assert resp.status_code == 404
        _assert_openai_error(resp.json(), "request_not_found")


def test_worker_urls_are_checked_before_the_router_starts() -> None:
    for url in ("http://127.0.0.1:99999", "http://[::1", "ftp://host", "http://:80"):
        with pytest.raises(ValueError, match="worker-urls"):
            RouterConfig(worker_urls=(url,))


def test_router_metrics_are_open_parse_and_count_what_happened() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    down = ReplicaUnavailable("cannot connect", dead=True)
    transport = FakeTransport({"a": lambda p, h: down, "b": ok_json()})
    auth = {"Authorization": "Bearer sekret"}
    with fake_router(transport, api_key="sekret") as client:
        for _ in range(3):
            assert client.post("/v1/chat/completions", json=CHAT, headers=auth).status_code == 200
        scrape = client.get("/metrics")  # no key: a Prometheus scrape needs none unless --protect-metrics
        assert scrape.status_code == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(scrape.text)
        for s in family.samples
    }
    p = "radixserve_router:"
    assert samples[(p + "replica_healthy", (("replica", "a"),))] == 0.0
    assert samples[(p + "replica_healthy", (("replica", "b"),))] == 1.0
    assert samples[(p + "replica_in_flight", (("replica", "b"),))] == 0.0
    assert samples[(p + "requests_routed_total", (("replica", "b"),))] == 3.0
    assert samples[(p + "replica_marked_unhealthy_total", (("replica", "a"),))] == 1.0  # (after a passed check)
    assert samples[(p + "requests_retried_elsewhere_total", (("replica", "a"),))] == 1.0
    assert samples[(p + "requests_refused_total", (("reason", "no_healthy_replica"),))] == 0.0
    assert sum(v for (name, _), v in samples.items() if name == p + "routing_decisions_total") >= 3


def test_responses_continue_on_the_replica_that_stored_them() -> None:
    """Round robin would alternate; a previous_response_id (learned from a JSON body or the first event of a
    stream) pins the follow-up, and GET of a stored response, to the replica whose store has it."""

    seen_paths: list[str] = []

    def replica(name: str) -> Behaviour:
        counter = iter(range(100))

        def answer(path: str, headers: Headers) -> FakeUpstream:
            seen_paths.append(path)
            rid = f"resp_{name}{next(counter)}"
            if path.endswith("/responses") and "stream" in name:
                event = {"type": "response.created", "response": {"id": rid, "object": "response"}}
                return FakeUpstream(200, [f"event: response.created\ndata: {json.dumps(event)}\n\n".encode()],
                                    "text/event-stream")
            return FakeUpstream(200, [json.dumps({"id": rid, "object": "response"}).encode()])

        return answer

    transport = FakeTransport({"a": replica("a"), "streamb": replica("streamb")})
    client = fake_router(transport)
    homes = set()
    for _ in range(2):  # round robin starts one conversation on each replica
        first = client.post("/v1/responses", json={"input": "hi"})
        home = first.headers[REPLICA_HEADER]
        homes.add(home)
        # From the stream replica the id comes in its first event.
        streamed = home != "a"
        rid = json.loads(first.text.split("data: ", 1)[1])["response"]["id"] if streamed else first.json()["id"]
        for _ in range(3):
            follow = client.post("/v1/responses", json={"input": "more", "previous_response_id": rid})
            assert follow.headers[REPLICA_HEADER] == home
        assert client.get(f"/v1/responses/{rid}").headers[REPLICA_HEADER] == home
        # A background response is streamed again (the query goes along) and cancelled where it runs.
        again = client.get(f"/v1/responses/{rid}", params={"stream": "true", "starting_after": 3})
        assert again.headers[REPLICA_HEADER] == home
        assert seen_paths[-1] == f"/v1/responses/{rid}?stream=true&starting_after=3"
        assert client.post(f"/v1/responses/{rid}/cancel").headers[REPLICA_HEADER] == home
        assert seen_paths[-1] == f"/v1/responses/{rid}/cancel"
    assert homes == {"a", "streamb"}
    # Requests that continue nothing still follow the policy, and Messages are routed too.
    seen = {client.post("/v1/responses", json={"input": "x"}).headers[REPLICA_HEADER] for _ in range(4)}
    assert seen == {"a", "streamb"}
    assert client.post("/v1/messages", json={"max_tokens": 4, "messages": []}).status_code == 200


def test_browsers_may_call_the_router_and_monitors_may_probe_with_head() -> None:
    """CORS is the router's: preflights are answered without the API key, and a replica's own CORS headers (it
    allows other origins than the router, or every one) never reach the client. HEAD works on GET routes."""
    def open_replica(path: str, headers: Headers) -> FakeUpstream:
        upstream = FakeUpstream(200, [b"{}"])
        upstream.headers.append(("access-control-allow-origin", "*"))
        return upstream

    transport = FakeTransport({"a": open_replica})
    routing = RoutingConfig(policy="round_robin", health_check_interval=60.0)
    config = RouterConfig(worker_urls=("http://unused",), api_key="sekret").server_config()
    app = create_router_app(ReplicaPool(["a"], make_policy("round_robin")), transport, config, routing)
    key = {"Authorization": "Bearer sekret"}
    with TestClient(app) as client:
        local, remote = {"Origin": "http://localhost:3000"}, {"Origin": "https://evil.example"}
        resp = client.options("/v1/chat/completions", headers={**local, "Access-Control-Request-Method": "POST"})
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "http://localhost:3000"
        resp = client.post("/v1/chat/completions", json=CHAT, headers=local)
        assert resp.status_code == 401 and resp.headers["access-control-allow-origin"] == "http://localhost:3000"
        resp = client.post("/v1/chat/completions", json=CHAT, headers={**key, **remote})
        assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers
        assert "origin" not in transport.calls[-1][2]  # the replica is not asked
        for path in ("/health", "/router_info", "/metrics"):
            resp = client.head(path, headers=key)
            assert resp.status_code == client.get(path, headers=key).status_code == 200, path
            assert resp.content == b""
