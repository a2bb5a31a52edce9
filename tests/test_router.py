"""The data-parallel router (``radixserve router``).

End to end on a tiny model (the proxy's rules over a fake transport are in test_router_proxy.py): two real
replicas (``python -m server.cli serve`` subprocesses) behind the router, driven with the official ``openai``
client:
  * cache hit rate of a 4-prefix workload: cache_aware within 10% (relative) of one replica's, round_robin clearly
    lower;
  * a client disconnecting from a stream aborts the request on the replica;
  * SIGKILL of one replica while requests flow: only the streams it was serving fail, every other request
    succeeds, /health stays 200, and the replica is out of rotation until it is back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from radixserve.server.router.config import RouterConfig, RoutingConfig
from radixserve.server.router.process import build_http_router
from radixserve.server.router.proxy import REPLICA_HEADER
from radixserve.server.testing import ServerThread, free_port

ROOT = Path(__file__).resolve().parent.parent

# --- two real replicas on a tiny model ------------------------------------------------------------------------

REPLICA_FLAGS = ["--device", "cpu", "--max-total-tokens", "8192", "--log-level", "warning"]
REPLICA_FLAGS += ["--served-model-name", "tiny"]
START_TIMEOUT_S = 120


@dataclass
class ReplicaProc:
    url: str
    port: int
    log: Path
    proc: subprocess.Popen | None = None
    args: list[str] = field(default_factory=list)

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self.args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"replica {self.url} did not become ready"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def replicas(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ReplicaProc]]:
    logs = tmp_path_factory.mktemp("replica-logs")
    procs = []
    for i in range(2):
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "radixserve.server.cli",
            "serve",
            "--model",
            str(tiny_model_dir),
            "--port",
            str(port),
        ]
        procs.append(ReplicaProc(f"http://127.0.0.1:{port}", port, logs / f"replica{i}.log", args=cmd + REPLICA_FLAGS))
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready()
        yield procs
    finally:
        for p in procs:
            p.stop()


def router_for(replicas: list[ReplicaProc], policy: str, **routing: Any) -> ServerThread:
    config = RouterConfig(worker_urls=tuple(r.url for r in replicas))
    app = build_http_router(config, RoutingConfig(policy=policy, **routing))
    return ServerThread(app)  # started by ``with``


# Four long, distinct system prompts (~200 tokens each with the tiny model's tokenizer) and short questions.
_SENTENCES = [
    "The scheduler decides which requests run in the next step.",
    "A radix tree stores those prefixes so that the longest match is found quickly.",
    "Chunked prefill splits a long prompt into pieces so that decoding requests are not starved.",
    "Sampling turns logits into a token: temperature scales them, top-k and top-p cut the tail.",
    "A grammar can constrain the output, for example to valid JSON that matches a schema.",
    "Memory is split into pages; a page holds the keys and values of a fixed number of tokens.",
    "Weights are stored in safetensors files; the config describes the architecture and its sizes.",
    "A stop string ends generation early. The end of sequence token ends it too.",
]
SYSTEM_PROMPTS = [
    f"You are assistant number {i}. " + " ".join(_SENTENCES[(i + k) % len(_SENTENCES)] for k in range(14))
    for i in range(4)
]
# Each prefix twice in a row first: round robin over two replicas then puts every prefix on both replicas (8
# misses), while one replica and cache_aware compute each prefix once (4 misses). Sequential, so deterministic.
ORDER = [0, 0, 1, 1, 2, 2, 3, 3, 0, 1, 2, 3, 3, 2, 1, 0]


def _messages(prefix: int, n: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM_PROMPTS[prefix]},
        {"role": "user", "content": f"Question {n}: what is {n} plus {prefix}?"},
    ]


def _cache_counters(urls: list[str]) -> tuple[int, int]:
    prompt = cached = 0
    for url in urls:
        stats = httpx.get(url + "/server_info", timeout=30).json()["cache_stats"]
        prompt += stats["prompt_tokens"]
        cached += stats["cached_prompt_tokens"]
    return prompt, cached


def _hit_rate(base_url: str, replica_urls: list[str]) -> tuple[float, list[str]]:
    """Run ORDER through ``base_url``; (hit rate over ``replica_urls``' counters, replica of each request)."""
    for url in replica_urls:
        assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
    before = _cache_counters(replica_urls)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    served, usage_prompt, usage_cached = [], 0, 0
    for n, prefix in enumerate(ORDER):
        messages = _messages(prefix, n)
        raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=2)
        completion = raw.parse()
        served.append(raw.headers.get(REPLICA_HEADER, "direct"))
        usage_prompt += completion.usage.prompt_tokens
        usage_cached += completion.usage.prompt_tokens_details.cached_tokens
    after = _cache_counters(replica_urls)
    prompt, cached = after[0] - before[0], after[1] - before[1]
    assert (prompt, cached) == (usage_prompt, usage_cached)  # the counters and the responses agree
    assert prompt > 16 * 150  # the prefixes are long
    return cached / prompt, served


def test_cache_aware_hit_rate_matches_one_replica_and_beats_round_robin(replicas: list[ReplicaProc]) -> None:
    urls = [r.url for r in replicas]
    single, _ = _hit_rate(urls[0], urls[:1])
    with router_for(replicas, "cache_aware") as router:
        cache_aware, served = _hit_rate(router.url, urls)
        stats = httpx.get(router.url + "/router_info").json()
    with router_for(replicas, "round_robin") as router:
        round_robin, _ = _hit_rate(router.url, urls)
    summary = f"single {single:.3f}, cache_aware {cache_aware:.3f}, round_robin {round_robin:.3f}"
    print(summary)  # shown with -s or on failure
    assert cache_aware >= 0.9 * single, summary  # within 10%, relative
    assert round_robin < 0.8 * cache_aware, summary
    for prefix in range(4):  # every prefix stayed on one replica, and both replicas were used
        assert len({s for s, p in zip(served, ORDER) if p == prefix}) == 1
    assert set(served) == set(urls)
    assert stats["routing"]["decisions"] == {"smallest_tree": 4, "prefix": 12}


def test_client_disconnect_aborts_the_stream_on_the_replica(replicas: list[ReplicaProc]) -> None:
    with router_for(replicas, "cache_aware") as router, httpx.Client(timeout=60) as http:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 1900, "ignore_eos": True, "stream": True}
        with http.stream("POST", router.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            replica = resp.headers[REPLICA_HEADER]
            before = httpx.get(replica + "/server_info").json()["cache_stats"]["requests_aborted"]
            for n, _ in enumerate(resp.iter_lines()):
                if n >= 6:
                    break
        deadline = time.monotonic() + 20
        while True:
            info = httpx.get(replica + "/server_info").json()
            routed = {r["id"]: r for r in httpx.get(router.url + "/router_info").json()["replicas"]}
            if info["cache_stats"]["requests_aborted"] == before + 1 and routed[replica]["in_flight"] == 0:
                break
            assert time.monotonic() < deadline, (info, routed)
            time.sleep(0.05)
        assert info["num_running_requests"] == 0


def test_client_disconnect_aborts_a_waiting_json_request(replicas: list[ReplicaProc]) -> None:
    """A non-streaming client that gives up while the replica generates: the router drops the upstream request,
    so the replica aborts it too."""
    urls = [r.url for r in replicas]
    with router_for(replicas, "cache_aware") as router:
        before = sum(httpx.get(u + "/server_info").json()["cache_stats"]["requests_aborted"] for u in urls)
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 1900, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(router.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
        deadline = time.monotonic() + 20
        while sum(httpx.get(u + "/server_info").json()["cache_stats"]["requests_aborted"] for u in urls) != before + 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        routed = httpx.get(router.url + "/router_info").json()["replicas"]
        deadline = time.monotonic() + 5
        while any(r["in_flight"] for r in routed):
            assert time.monotonic() < deadline, routed
            time.sleep(0.05)
            routed = httpx.get(router.url + "/router_info").json()["replicas"]


@dataclass
class Outcome:
    start: float
    replica: str | None = None
    ok: bool = False
    stream: bool = False
    error: str = ""


def _client_loop(base_url: str, worker: int, stop: threading.Event, out: list[Outcome]) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    n = 0
    while not stop.is_set():
        n += 1
        stream = n % 2 == 0
        outcome = Outcome(time.monotonic(), stream=stream)
        out.append(outcome)
        try:
            raw = client.chat.completions.with_raw_response.create(
                model="tiny", messages=_messages((worker + n) % 4, n), max_tokens=24, stream=stream
            )
            outcome.replica = raw.headers.get(REPLICA_HEADER)
            parsed = raw.parse()
            if stream:
                chunks = list(parsed)
                assert chunks and chunks[-1].choices[0].finish_reason is not None
            else:
                assert parsed.choices[0].finish_reason is not None
            outcome.ok = True
        except Exception as exc:  # noqa: BLE001 - recorded, judged by the test
            outcome.error = f"{type(exc).__name__}: {exc}"


def test_killing_a_replica_loses_no_request_it_was_not_serving(replicas: list[ReplicaProc]) -> None:
    """Runs last: it kills the second replica, then starts it again and sees it back in rotation."""
    survivor, victim = replicas
    with router_for(replicas, "cache_aware", health_check_interval=0.3) as router:
        stop, outcomes = threading.Event(), []
        health_codes: list[int] = []

        def poll_health() -> None:
            while not stop.is_set():
                health_codes.append(httpx.get(router.url + "/health", timeout=10).status_code)
                time.sleep(0.1)

        threads = [threading.Thread(target=_client_loop, args=(router.url, w, stop, outcomes)) for w in range(4)]
        threads.append(threading.Thread(target=poll_health))
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 30
            while {o.replica for o in outcomes if o.ok} != {survivor.url, victim.url}:
                assert time.monotonic() < deadline, outcomes
                time.sleep(0.05)
            assert victim.proc is not None
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait(10)
            killed_at = time.monotonic()
            time.sleep(2.0)  # requests keep flowing
        finally:
            stop.set()
            for t in threads:
                t.join(90)
        after = [o for o in outcomes if o.start > killed_at]
        assert len(after) >= 4 and all(o.ok and o.replica == survivor.url for o in after), after
        failed = [o for o in outcomes if not o.ok]
        print(f"{len(outcomes)} requests, {len(after)} after the kill, {len(failed)} failed: {failed}")
        for o in failed:  # only streams the victim had already started answering may fail
            assert o.stream and o.replica == victim.url and o.start < killed_at, o
        assert health_codes and set(health_codes) == {200}
        info = {r["id"]: r for r in httpx.get(router.url + "/router_info").json()["replicas"]}
        assert not info[victim.url]["healthy"] and info[survivor.url]["healthy"]
        assert info[victim.url]["requests_failed"] == len(failed)
        assert info[victim.url]["in_flight"] == 0 and info[survivor.url]["in_flight"] == 0
        assert info[victim.url]["tree_chars"] == 0

        victim.start()  # back on the same port: the health checks bring it back, its tree empty
        victim.wait_ready()
        deadline = time.monotonic() + 30
        while not httpx.get(router.url + "/router_info").json()["replicas"][1]["healthy"]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        fresh = [{"role": "system", "content": "A brand new prefix. " * 40}, {"role": "user", "content": "hi"}]
        raw = client.chat.completions.with_raw_response.create(model="tiny", messages=fresh, max_tokens=2)
        assert raw.headers[REPLICA_HEADER] == victim.url  # the smallest (empty) tree takes a new prefix
