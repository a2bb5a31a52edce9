"""Security and grammar safety: loopback by default, admin routes behind the API key, request content that never
becomes code or a file access, no prompt text in the logs at info level, and a grammar whose compilation hangs
that fails its own request (400) without holding up anyone else."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixserve.runtime.engine import Engine
from radixserve.runtime.request import Req
from radixserve.server import ServerConfig, create_app
from radixserve.server.cli import build_parser
from radixserve.server.testing import ServerThread
from tests.test_server_tiny import USER, assert_error, wait_idle

SECRET = "zebra-quartz-7741 my bank PIN"
KEY = "k" * 32


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXSERVE_CHECK_INTEGRITY", "1")
        eng = Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=2048, grammar_compile_timeout=1.0)
    yield eng
    eng.shutdown()


def test_binds_loopback_by_default() -> None:
    assert ServerConfig().host == "127.0.0.1"
    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1"


def test_every_route_but_health_and_metrics_needs_the_key(engine: Engine) -> None:
    with (
        ServerThread(create_app(engine, ServerConfig(api_key=KEY))) as srv,
        httpx.Client(base_url=srv.url, timeout=30) as http,
    ):
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200  # as with vLLM: a Prometheus scrape needs no token
        wrong = {"Authorization": "Bearer " + "k" * 31 + "x"}  # same length, one character off
        calls = [
            ("POST", "/flush_cache", None),
            ("POST", "/abort_request", {"abort_all": True}),
            ("GET", "/server_info", None),
            ("POST", "/generate", {"text": "x"}),
            ("POST", "/tokenize", {"prompt": "x"}),
            ("GET", "/v1/models", None),
            ("POST", "/v1/chat/completions", {"messages": USER}),
        ]
        for method, path, body in calls:
            for headers in ({}, wrong, {"Authorization": KEY}):
                resp = http.request(method, path, json=body, headers=headers)
                err = assert_error(resp, 401)
                assert err["code"] == "invalid_api_key" and resp.headers["WWW-Authenticate"] == "Bearer"
        good = {"Authorization": f"Bearer {KEY}"}
        assert http.post("/flush_cache", headers=good).json()["success"] is True
        assert KEY not in http.get("/server_info", headers=good).text
    protected = ServerConfig(api_key=KEY, protect_metrics=True)
    with ServerThread(create_app(engine, protected)) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        assert_error(http.get("/metrics"), 401)
        assert http.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_browser_clients_and_head_probes(engine: Engine) -> None:
    """CORS: by default only pages on this machine may call the API from a browser (a page anywhere else could
    otherwise run generations on a server without a key and read them). A preflight is answered without the key;
    an answer, an error included, is readable by an allowed page and by no other. HEAD answers on every GET route."""
    local, remote = {"Origin": "http://localhost:5173"}, {"Origin": "https://evil.example"}
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    good = {"Authorization": f"Bearer {KEY}"}
    with (
        ServerThread(create_app(engine, ServerConfig(api_key=KEY))) as srv,
        httpx.Client(base_url=srv.url, timeout=30) as http,
    ):
        resp = http.options("/v1/chat/completions", headers={**local, **ask})
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "http://localhost:5173"
        assert "authorization" in resp.headers["access-control-allow-headers"].lower()
        resp = http.post("/v1/chat/completions", json={"messages": USER}, headers=local)
        assert_error(resp, 401)
        assert resp.headers["access-control-allow-origin"] == "http://localhost:5173"
        assert "x-request-id" in resp.headers["access-control-expose-headers"].lower()
        other = http.options("/v1/chat/completions", headers={**remote, **ask})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        assert "access-control-allow-origin" not in http.get("/health", headers=remote).headers
        for path in ("/health", "/v1/models", "/server_info", "/metrics"):
            head, get = http.head(path, headers=good), http.get(path, headers=good)
            assert head.status_code == get.status_code == 200 and head.content == b"", path
        assert http.head("/v1/models").status_code == 401
    named = ServerConfig(allowed_origins=("https://*.example.com",), allow_credentials=True)
    with ServerThread(create_app(engine, named)) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        resp = http.options("/v1/models", headers={"Origin": "https://app.example.com", **ask})
        assert resp.headers["access-control-allow-origin"] == "https://app.example.com"
        assert resp.headers["access-control-allow-credentials"] == "true"
        for origin in ("https://evil.example", "https://a.b.example.com", "http://localhost:5173"):
            assert "access-control-allow-origin" not in http.get("/v1/models", headers={"Origin": origin}).headers
    with ServerThread(create_app(engine, ServerConfig(allowed_origins=("*",)))) as srv:
        resp = httpx.options(srv.url + "/v1/chat/completions", headers={**remote, **ask})
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "*"
    with ServerThread(create_app(engine, ServerConfig(allowed_origins=("",)))) as srv:
        resp = httpx.options(srv.url + "/v1/chat/completions", headers={**local, **ask})
        assert resp.status_code == 405 and "access-control-allow-origin" not in resp.headers


def test_an_unexpected_error_is_a_500_a_browser_can_read(engine: Engine) -> None:
    """Starlette answers an exception outside every middleware: the 500 had no X-Request-Id (the id a user
    reports) and no CORS headers (a page could not read it)."""
    app = create_app(engine, ServerConfig())

    async def broken() -> None:
        raise RuntimeError("a bug")

    app.add_api_route("/broken", broken, methods=["GET"])
    with ServerThread(app) as srv:
        resp = httpx.get(srv.url + "/broken", headers={"Origin": "http://localhost:8080", "X-Request-Id": "r-42"})
    err = assert_error(resp, 500)
    assert "RuntimeError" in err["message"] and err["type"] == "server_error"
    assert resp.headers["x-request-id"] == "r-42"
    assert resp.headers["access-control-allow-origin"] == "http://localhost:8080"


def test_request_content_is_never_code_or_a_path(engine: Engine) -> None:
    """Template syntax in a message is text; template variables from the request cannot replace the template or
    the conversation; a model name that is a path loads nothing."""
    with ServerThread(create_app(engine, ServerConfig())) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        payload = "{{ 7 * 7 }} {% for x in range(3) %}loop{% endfor %} {{ ''.__class__.__mro__ }}"
        rendered = http.post("/tokenize", json={"messages": [{"role": "user", "content": payload}]}).json()["prompt"]
        assert payload in rendered and "49" not in rendered and "looploop" not in rendered

        def prompt_tokens(**extra: Any) -> int:
            body = {"messages": USER, "max_tokens": 1, **extra}
            resp = http.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            return resp.json()["usage"]["prompt_tokens"]

        hostile = {"chat_template": "{{ 'pwned' * 500 }}", "messages": [], "add_generation_prompt": False}
        assert prompt_tokens(chat_template_kwargs=hostile) == prompt_tokens()
        for model in ("/etc/passwd", "../../../../etc/passwd", "smollm2-135m-instruct"):
            assert_error(http.post("/v1/chat/completions", json={"model": model, "messages": USER}), 404)


def test_logs_hold_no_prompts(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    """At info level, neither served requests, refused ones nor failed ones put prompt text into the logs."""
    core = engine.core
    real_append = core._append_token

    def append(req: Req, token: int, logprob: Any, now: float) -> None:
        if req.rid.startswith("fault"):
            raise RuntimeError("simulated fault")
        real_append(req, token, logprob, now)

    with (
        caplog.at_level(logging.INFO),
        ServerThread(create_app(engine, ServerConfig()), log_level="info") as srv,
        httpx.Client(base_url=srv.url, timeout=30) as http,
    ):
        messages = [{"role": "user", "content": SECRET}]
        calls = [
            ("/v1/chat/completions", {"messages": messages, "max_tokens": 3}, 200),
            ("/v1/completions", {"prompt": SECRET, "max_tokens": 3, "stream": True}, 200),
            ("/generate", {"text": SECRET, "sampling_params": {"max_new_tokens": 2}}, 200),
            ("/v1/chat/completions", {"messages": [{"role": SECRET, "content": "x"}]}, 400),
            ("/v1/chat/completions", {"messages": messages, "regex": SECRET + "("}, 400),
        ]
        for path, body, status in calls:
            assert http.post(path, json=body).status_code == status
        core._append_token = append  # type: ignore[method-assign]
        try:
            resp = http.post("/generate", json={"text": SECRET, "rid": "fault-1"})
        finally:
            core._append_token = real_append  # type: ignore[method-assign]
        assert resp.status_code == 500
    assert "simulated fault" in caplog.text  # the fault itself is logged, with its traceback
    assert SECRET not in caplog.text
    assert SECRET.split()[0] not in caplog.text


def test_hanging_compile_fails_alone(engine: Engine) -> None:
    """A constraint whose compilation runs past --grammar-compile-timeout gets a 400 (code constraint_timeout);
    while it compiles, other requests are served; the compiler stays usable."""
    compiler = engine.grammar.compiler
    real_compile = compiler.backend.compile
    compiling = threading.Event()
    compile_done = threading.Event()

    def slow_compile(spec: Any) -> Any:
        if spec.kind == "regex" and spec.value == "slow-[a-z]+":
            compiling.set()
            time.sleep(4.0)  # past the 1 s timeout; the worker is abandoned, not waited for
            compile_done.set()
        return real_compile(spec)

    compiler.backend.compile = slow_compile  # type: ignore[method-assign]
    try:
        with (
            ServerThread(create_app(engine, ServerConfig())) as srv,
            httpx.Client(base_url=srv.url, timeout=30) as http,
        ):
            slow: Future[httpx.Response] = Future()
            body = {"messages": USER, "max_tokens": 8, "regex": "slow-[a-z]+"}
            threading.Thread(target=lambda: slow.set_result(http.post("/v1/chat/completions", json=body))).start()
            assert compiling.wait(30)
            fast = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 8, "ignore_eos": True})
            assert fast.status_code == 200 and fast.json()["usage"]["completion_tokens"] == 8
            other = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 8, "regex": "[0-9]+"})
            assert other.status_code == 200
            assert not compile_done.is_set(), "the others were served while the slow grammar still compiled"
            err = assert_error(slow.result(60), 400, param="regex")
            assert err["code"] == "constraint_timeout"
            wait_idle(http)
    finally:
        compiler.backend.compile = real_compile  # type: ignore[method-assign]
    engine.call(lambda core: core.cache.check(core.scheduler.holders()))
