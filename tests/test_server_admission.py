"""Chat requests without ``max_tokens`` (the OpenAI SDK's and LangChain's default) do not throttle admission.

The server gives such a request all the room left in the context as its budget; on a 16K-token pool, reserving
KV for a share of that let one request run and kept every other waiting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from radixserve.runtime.engine import Engine
from radixserve.server import ServerConfig, create_app
from radixserve.server.testing import ServerThread
from tests.test_server_tiny import wait_idle
from tests.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-32k"), max_position=32768)


@pytest.fixture(scope="module")
def served(long_context_model: Path) -> Iterator[tuple[ServerThread, Engine]]:
    engine = Engine(model=str(long_context_model), device="cpu", max_total_tokens=16384)
    try:
        with ServerThread(create_app(engine, ServerConfig(served_model_name="tiny"))) as srv:
            yield srv, engine
    finally:
        engine.shutdown()


def test_sixteen_chats_without_max_tokens_run_at_least_eight_at_once(served: tuple[ServerThread, Engine]) -> None:
    srv, engine = served
    stop = threading.Event()
    started = threading.Barrier(17)

    def chat(i: int) -> None:
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"Tell me a long story, number {i}."}],
            "stream": True,
            "ignore_eos": True,  # run until the client goes away
        }
        with (
            httpx.Client(base_url=srv.url, timeout=60) as http,
            http.stream("POST", "/v1/chat/completions", json=body) as resp,
        ):
            assert resp.status_code == 200
            started.wait(30)
            for _ in resp.iter_lines():
                if stop.is_set():
                    return  # closing the stream aborts the request

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    most = 0
    try:
        started.wait(30)
        deadline = time.monotonic() + 10
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            while time.monotonic() < deadline and most < 16:
                most = max(most, http.get("/server_info").json()["num_running_requests"])
                time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert most >= 8, f"at most {most} of 16 requests ran at once"
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        wait_idle(http, timeout=30)
    engine.call(lambda core: core.cache.check(core.scheduler.holders()))
