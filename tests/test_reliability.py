"""Reliability of the engine and the server under overload and faults: an exact bound on the waiting queue (429
with Retry-After beyond it), a request that fails alone (500 naming the cause) while the others run on, a dead
engine reported by /health, and requests that are never left without an answer. KV accounting is checked after
each scenario."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixserve.constrained import ConstraintSpec
from radixserve.runtime.engine import Engine, EngineOverloadedError
from radixserve.runtime.request import FinishReason, Req, ReqOutput
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.server import ServerConfig, create_app
from radixserve.server.testing import ServerThread
from tests.test_server_tiny import assert_error, sse_events, wait_idle


def _engine(model: Path, **kw: Any) -> Engine:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXSERVE_CHECK_INTEGRITY", "1")
        return Engine(model=str(model), device="cpu", max_total_tokens=2048, **kw)


def _check_kv(engine: Engine) -> None:
    """Idle engine: every slot free or held by the radix tree, the tree intact, nothing queued or unfinished."""
    engine.call(lambda core: core.cache.check(core.scheduler.holders()))
    usage = engine.call(lambda core: core.kv_usage())
    assert usage["in_use_tokens"] == 0, usage
    assert engine.num_unfinished == 0 and engine.num_queued == 0


class _Sink:
    """Collects one request's outputs; ``done`` resolves with the final one."""

    def __init__(self) -> None:
        self.outputs: list[ReqOutput] = []
        self.done: Future[ReqOutput] = Future()

    def __call__(self, out: ReqOutput) -> None:
        self.outputs.append(out)
        if out.finished:
            self.done.set_result(out)


class _Paused:
    """Holds the engine thread between two steps (inside ``Engine.call``) until the block exits."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.entered = threading.Event()
        self.release = threading.Event()

    def __enter__(self) -> _Paused:
        def hold(_core: Any) -> None:
            self.entered.set()
            self.release.wait(60)

        self.thread = threading.Thread(target=self.engine.call, args=(hold,), kwargs={"timeout": 90})
        self.thread.start()
        assert self.entered.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.thread.join(60)


def _wait(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


# --- the engine -----------------------------------------------------------------------------------------------
def test_queue_bound_is_exact_and_ignores_running(tiny_model_dir: Path) -> None:
    """``--max-queued-requests`` bounds what waits for admission, exactly; running requests do not count."""
    engine = _engine(tiny_model_dir, max_running_requests=1, max_queued_requests=3)
    try:
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        with _Paused(engine):
            sinks = [_Sink() for _ in range(3)]
            for sink in sinks:
                engine.submit([5, 6, 7], params, sink)
            assert engine.num_queued == 3
            with pytest.raises(EngineOverloadedError, match="max-queued-requests 3"):
                engine.submit([5, 6, 7], params, _Sink())
        for sink in sinks:
            assert sink.done.result(30).finish_reason == FinishReason.LENGTH

        long = _Sink()
        long_rid = engine.submit([9, 10], SamplingParams(max_new_tokens=1500, ignore_eos=True), long)
        _wait(lambda: engine.num_queued == 0 and len(long.outputs) > 0, "the long request runs")
        with _Paused(engine):
            queued = [_Sink() for _ in range(3)]
            for sink in queued:
                engine.submit([5, 6, 7], params, sink)  # the running request leaves the queue's room intact
            with pytest.raises(EngineOverloadedError):
                engine.submit([5, 6, 7], params, _Sink())
            engine.abort(long_rid)
        assert long.done.result(30).finish_reason == FinishReason.ABORT
        for sink in queued:
            assert sink.done.result(30).finish_reason == FinishReason.LENGTH
        with pytest.raises(EngineOverloadedError):  # a batch is all or nothing: the queued part is aborted
            engine.generate(input_ids=[[5, 6, 7]] * 5, sampling_params={"max_new_tokens": 1500, "ignore_eos": True})
        _wait(lambda: engine.num_unfinished == 0, "the batch's queued requests are aborted", timeout=1.5)
        _check_kv(engine)
    finally:
        engine.shutdown()


def test_bad_requests_fail_alone(tiny_model_dir: Path) -> None:
    """A duplicate rid, or a fault while adding one request, fails that request only: the request that already
    has the rid keeps its output stream, and the engine keeps serving."""
    engine = _engine(tiny_model_dir)
    try:
        params = SamplingParams(max_new_tokens=6, ignore_eos=True)
        with _Paused(engine):
            first, dup = _Sink(), _Sink()
            engine.submit([5, 6, 7], params, first, rid="same")
            engine.submit([8, 9], params, dup, rid="same")
        assert dup.done.result(30).finish_reason == FinishReason.ERROR
        assert "already in use" in (dup.done.result().error or "")
        final = first.done.result(30)
        assert final.finish_reason == FinishReason.LENGTH and final.completion_tokens == 6

        real_add = engine.core.add

        def faulty_add(req: Req) -> None:
            if req.rid == "poison":
                raise RuntimeError("simulated fault while setting up the request")
            real_add(req)

        engine.core.add = faulty_add  # type: ignore[method-assign]
        poisoned, healthy = _Sink(), _Sink()
        engine.submit([5, 6], params, poisoned, rid="poison")
        engine.submit([5, 6], params, healthy)
        out = poisoned.done.result(30)
        assert out.finish_reason == FinishReason.ERROR and "simulated fault" in (out.error or "")
        assert healthy.done.result(30).finish_reason == FinishReason.LENGTH
        assert engine.alive
        _check_kv(engine)
    finally:
        engine.shutdown()


def test_shutdown_answers_every_request(tiny_model_dir: Path) -> None:
    """Requests still compiling their grammar, queued or running when the engine stops all get a final output
    (finish_reason abort); nothing submitted afterwards is accepted."""
    engine = _engine(tiny_model_dir, max_running_requests=1)
    never: Future[Any] = Future()  # a compile that never finishes
    engine.grammar.compile = lambda spec: never  # type: ignore[method-assign]
    sinks = [_Sink() for _ in range(3)]
    engine.submit([5, 6], SamplingParams(max_new_tokens=1500, ignore_eos=True), sinks[0])
    engine.submit([5, 6], SamplingParams(max_new_tokens=4), sinks[1])
    engine.submit([5, 6], SamplingParams(max_new_tokens=4, constraint=ConstraintSpec("regex", "a+")), sinks[2])
    _wait(lambda: len(sinks[0].outputs) > 0, "the first request runs")
    # The call runs after the adds (the inbox is FIFO): one request in each place a shutdown must empty.
    where = engine.call(lambda c: [len(c.scheduler.running), len(c.scheduler.waiting), len(c.grammar_queue)])
    assert where == [1, 1, 1]
    engine.shutdown()
    for sink in sinks:
        final = sink.done.result(10)
        assert final.finish_reason == FinishReason.ABORT, final
    with pytest.raises(RuntimeError, match="shut down"):
        engine.submit([5, 6], SamplingParams(), _Sink())


def test_one_token_chunk_after_an_extend(tiny_model_dir: Path) -> None:
    """A request admitted with all but one prompt token cached (a repeated prompt, the 2nd choice of n > 1) while
    another request is part-way through its prefill gets exactly the log-probabilities it gets alone."""
    engine = _engine(tiny_model_dir, chunked_prefill_size=64)
    try:

        def drive(core: Any) -> tuple[list[float], list[float]]:
            def params() -> SamplingParams:
                return SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, ignore_eos=True, return_logprob=True)

            prompt = [(7 * i) % 300 + 5 for i in range(40)]
            lps: dict[str, list[float]] = {"alone": [], "late": []}

            def step() -> None:
                for out in core.step():
                    if out.rid in lps:
                        lps[out.rid].extend(lp.logprob for lp in out.logprobs)

            core.add(Req("alone", prompt, params()))
            while core.has_work():
                step()
            core.add(Req("long", [(11 * i) % 300 + 5 for i in range(100)], params()))
            step()  # 64 of its 100 prompt tokens: the next step extends it by 36, leaving room to admit more
            core.add(Req("late", prompt, params()))  # all but its last prompt token are cached: a 1-token chunk
            while core.has_work():
                step()
            return lps["alone"], lps["late"]

        alone, late = engine.call(drive)
        assert late == pytest.approx(alone, abs=1e-4)
    finally:
        engine.shutdown()


# --- the server -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[tuple[ServerThread, Engine]]:
    engine = _engine(tiny_model_dir, max_running_requests=2, max_queued_requests=3)
    try:
        with ServerThread(create_app(engine, ServerConfig())) as srv:
            yield srv, engine
    finally:
        engine.shutdown()


async def _burst(url: str, clients: int, body: dict[str, Any]) -> list[tuple[httpx.Response, float]]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:

        async def one() -> tuple[httpx.Response, float]:
            start = time.monotonic()
            resp = await http.post("/v1/completions", json=body)
            return resp, time.monotonic() - start

        return list(await asyncio.gather(*(one() for _ in range(clients))))


def test_overload_429_then_retry(served: tuple[ServerThread, Engine]) -> None:
    """More clients than the queue admits: the rest get 429 with Retry-After, the admitted ones finish in full
    within a bounded time, and clients that honour Retry-After all get served in the end."""
    srv, engine = served
    body = {"prompt": "hello", "max_tokens": 256, "ignore_eos": True}  # long enough to outlast the burst
    results = asyncio.run(_burst(srv.url, 16, body))
    admitted = [(r, t) for r, t in results if r.status_code == 200]
    refused = [r for r, _ in results if r.status_code != 200]
    assert len(admitted) >= 3 and refused, [r.status_code for r, _ in results]
    for resp in refused:
        err = assert_error(resp, 429, text="max-queued-requests")
        assert err["type"] == "rate_limit_error" and err["code"] == "overloaded"
        assert int(resp.headers["Retry-After"]) >= 1
    for resp, seconds in admitted:
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "length" and resp.json()["usage"]["completion_tokens"] == 256
        assert seconds < 60, "an admitted request's latency must stay bounded under overload"

    async def polite_client(http: httpx.AsyncClient) -> int:
        for attempt in range(60):
            resp = await http.post("/v1/completions", json=body)
            if resp.status_code != 429:
                return attempt
            await asyncio.sleep(float(resp.headers["Retry-After"]))
        raise AssertionError("a client honouring Retry-After was never served")

    async def retry_all() -> list[int]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
            return list(await asyncio.gather(*(polite_client(http) for _ in range(len(refused)))))

    attempts = asyncio.run(retry_all())
    assert len(attempts) == len(refused)
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        wait_idle(http)
        metrics = http.get("/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("radixserve:request_refused_total{"))
    assert 'reason="queue_full"' in line and float(line.rsplit(" ", 1)[1]) >= len(refused) + sum(attempts)
    _check_kv(engine)


def test_request_fault_is_500_others_continue(served: tuple[ServerThread, Engine]) -> None:
    """A fault while serving one request (here, in its detokenization) fails it alone with a 500 naming the
    cause, in its stream too; a request running beside it finishes normally."""
    srv, engine = served
    core = engine.core
    real_append = core._append_token

    def append(req: Req, token: int, logprob: Any, now: float) -> None:
        if req.rid.startswith("poison") and req.output_ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated detokenizer fault")
        real_append(req, token, logprob, now)

    core._append_token = append  # type: ignore[method-assign]
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            long = {"text": "hi", "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
            healthy: Future[httpx.Response] = Future()
            threading.Thread(target=lambda: healthy.set_result(http.post("/generate", json=long))).start()
            bad = {"text": "hi", "rid": "poison-1", "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
            err = assert_error(http.post("/generate", json=bad), 500, text="simulated detokenizer fault")
            assert err["code"] == "engine_error" and "UnicodeDecodeError" in err["message"]
            with http.stream("POST", "/generate", json={**bad, "rid": "poison-2", "stream": True}) as resp:
                assert resp.status_code == 200  # the headers went out before the fault
                events = sse_events(resp.iter_lines())
            assert events[-1] == "[DONE]" and "simulated detokenizer fault" in events[-2]["error"]["message"]
            ok = healthy.result(60)
            assert ok.status_code == 200 and ok.json()["meta_info"]["finish_reason"]["type"] == "length"
            assert http.get("/health").json() == {"status": "ready"}
            wait_idle(http)
    finally:
        core._append_token = real_append  # type: ignore[method-assign]
    _check_kv(engine)


def test_dead_engine_is_reported(tiny_model_dir: Path) -> None:
    """A fault in the engine loop itself: the running request fails with the cause, /health answers 503
    "dead" with the reason, and new requests get 503."""
    engine = _engine(tiny_model_dir)
    try:
        with ServerThread(create_app(engine, ServerConfig())) as srv, httpx.Client(base_url=srv.url) as http:
            assert http.get("/health").status_code == 200

            def broken_schedule() -> Any:
                raise RuntimeError("simulated scheduler bug")

            engine.core.scheduler.schedule = broken_schedule  # type: ignore[method-assign]
            err = assert_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4}), 500)
            assert "simulated scheduler bug" in err["message"]
            health = http.get("/health")
            assert health.status_code == 503
            assert health.json()["status"] == "dead" and "simulated scheduler bug" in health.json()["message"]
            assert_error(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4}), 503)
    finally:
        engine.shutdown()
