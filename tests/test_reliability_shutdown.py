"""Start-up and shutdown: 503 with Retry-After while the model loads or the server drains, and a graceful
shutdown (SIGTERM for the CLI, ``ServerThread.stop`` in-process) that lets short requests finish, aborts what is
still running when the grace period ends (streams end with finish_reason "abort" and [DONE]), leaks no KV, and
exits with status 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixserve.runtime.engine import Engine
from radixserve.server import ServerConfig, create_app
from radixserve.server.testing import ServerThread, free_port, reap, wait_healthy
from tests.test_server_tiny import USER, assert_error, sse_events

ROOT = Path(__file__).resolve().parent.parent
GRACE_S = 2.0
STEP_DELAY_S = 0.005  # added to every engine step, so that LONG outlasts the grace period on any machine
# The engine process (`python -m radixserve.runtime.engine_worker FD`) with that delay injected into its model runner.
SLOW_ENGINE = f"""
import runpy, sys, time
from radixserve.runtime.model_runner import ModelRunner
run = ModelRunner.run
def slow_run(self, plan):
    time.sleep({STEP_DELAY_S})
    return run(self, plan)
ModelRunner.run = slow_run
sys.argv = ["radixserve.runtime.engine_worker", *sys.argv[1:]]
runpy.run_module("radixserve.runtime.engine_worker", run_name="__main__", alter_sys=True)
"""
# ``python -m server.cli`` (runpy is what -m uses) whose engine process starts as SLOW_ENGINE (the model runs
# there, not in this process: a delay injected here would not slow its steps).
SLOW_CLI = f"""
import runpy, subprocess, sys
import radixserve.server  # first, as `python -m server.cli` imports it first
import radixserve.runtime.engine_spawn as spawn
class _Subprocess:
    def __getattr__(self, name):
        return getattr(subprocess, name)
    @staticmethod
    def Popen(argv, **kwargs):
        if list(argv[1:3]) == ["-m", "radixserve.runtime.engine_worker"]:
            argv = [argv[0], "-c", {SLOW_ENGINE!r}, *argv[3:]]
        return subprocess.Popen(argv, **kwargs)
spawn.subprocess = _Subprocess()
sys.argv = ["radixserve.server.cli", *sys.argv[1:]]
runpy.run_module("radixserve.server.cli", run_name="__main__", alter_sys=True)
"""
LONG = {"prompt": "hello", "max_tokens": 1900, "ignore_eos": True, "stream": True}
SHORT = {"prompt": "hello", "max_tokens": 8, "ignore_eos": True}


def _stream_in_background(url: str, body: dict[str, Any]) -> tuple[threading.Event, Future[list[Any]]]:
    """Start a streaming completion; ``started`` is set at its first event, the future gets all its events."""
    started = threading.Event()
    result: Future[list[Any]] = Future()

    def run() -> None:
        try:
            with httpx.Client(timeout=120) as http, http.stream("POST", url + "/v1/completions", json=body) as resp:
                lines = []
                for line in resp.iter_lines():
                    lines.append(line)
                    started.set()
                result.set_result(sse_events(iter(lines)))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result.set_exception(exc)
            started.set()

    threading.Thread(target=run, daemon=True).start()
    return started, result


def _post_in_background(url: str, path: str, body: dict[str, Any]) -> Future[httpx.Response]:
    result: Future[httpx.Response] = Future()

    def run() -> None:
        try:
            result.set_result(httpx.post(url + path, json=body, timeout=120))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return result


def _assert_aborted_stream(events: list[Any]) -> None:
    assert events[-1] == "[DONE]", events[-3:]
    errors = [e for e in events[:-1] if "choices" not in e]
    assert not errors, errors
    finals = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
    assert finals[-1] == "abort" and all(f is None for f in finals[:-1])


def test_503_with_retry_after_while_loading_and_draining(tiny_model_dir: Path) -> None:
    release = threading.Event()

    def factory() -> Engine:
        release.wait(30)
        return Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=1024)

    app = create_app(factory, ServerConfig(), model=str(tiny_model_dir))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        resp = http.post("/v1/chat/completions", json={"messages": USER})
        assert_error(resp, 503, text="still loading")
        assert int(resp.headers["Retry-After"]) > 0
        release.set()
        deadline = time.monotonic() + 30
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        app.state.server.draining = True  # what a shutdown sets first
        resp = http.post("/v1/chat/completions", json={"messages": USER})
        err = assert_error(resp, 503, text="shutting down")
        assert err["code"] == "engine_draining" and int(resp.headers["Retry-After"]) > 0
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"


def test_graceful_stop_in_process(tiny_model_dir: Path) -> None:
    """``ServerThread.stop`` shuts down as SIGTERM does: a short request finishes, a long stream is aborted at the
    end of the grace period, and the engine (owned by the caller) holds no KV afterwards."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXSERVE_CHECK_INTEGRITY", "1")
        engine = Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=4096)
    real_run = engine.core.runner.run

    def slow_run(plan: Any) -> Any:
        time.sleep(STEP_DELAY_S)
        return real_run(plan)

    engine.core.runner.run = slow_run  # type: ignore[method-assign]
    try:
        srv = ServerThread(create_app(engine, ServerConfig(shutdown_grace_period=GRACE_S))).start()
        started, stream = _stream_in_background(srv.url, LONG)
        assert started.wait(30)
        short = _post_in_background(srv.url, "/v1/completions", SHORT)
        time.sleep(0.2)  # let the short request reach the engine before the shutdown starts
        begin = time.monotonic()
        srv.stop()
        assert not srv.thread.is_alive()
        _assert_aborted_stream(stream.result(30))
        resp = short.result(30)
        assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "length"
        assert time.monotonic() - begin < GRACE_S + 30
        usage = engine.call(lambda core: core.kv_usage())
        assert usage["in_use_tokens"] == 0
        engine.call(lambda core: core.cache.check(core.scheduler.holders()))
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.url + "/health", timeout=5)
    finally:
        engine.shutdown()


def test_sigterm_exits_zero_after_draining(tiny_model_dir: Path) -> None:
    """``python -m server.cli serve`` on SIGTERM (to its process group): stops accepting, lets the short request
    finish, aborts the long stream when the grace period ends (it still ends with [DONE]), and exits with status
    0. (Each engine step is slowed by a few milliseconds, so that the long stream cannot finish within the grace
    period.)"""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-c", SLOW_CLI, "serve", "--model", str(tiny_model_dir), "--device", "cpu"]
    cmd += ["--port", str(port), "--max-total-tokens", "4096", "--shutdown-grace-period", str(GRACE_S)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # In a session of its own, so that SIGTERM goes to the whole group, as supervisors send it (systemd's
    # control-group kill, dumb-init, `timeout`): the engine process gets it too and must leave the drain to the
    # front end.
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        wait_healthy(proc, url)
        started, stream = _stream_in_background(url, LONG)
        assert started.wait(30)
        short = _post_in_background(url, "/v1/completions", SHORT)
        time.sleep(0.2)
        begin = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        _assert_aborted_stream(stream.result(GRACE_S + 30))
        resp = short.result(30)
        assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "length"
        code = proc.wait(timeout=GRACE_S + 60)
        assert code == 0
        assert time.monotonic() - begin < GRACE_S + 60
        log = proc.stdout.read() if proc.stdout else ""
        assert "shutting down: " in log and "aborting 1 unfinished" in log, log[-2000:]
    finally:
        reap(proc)

