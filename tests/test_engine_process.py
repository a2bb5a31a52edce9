"""The engine in a process of its own (``EngineProcess``): the same outputs and errors as the in-process engine,
refusals at once, KV freed on aborts, and nothing left hanging when either process dies."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from radixserve.constrained import ConstraintSpec, GrammarError
from radixserve.runtime.engine import Engine, EngineDeadError, EngineOverloadedError
from radixserve.runtime.engine_process import EngineProcess
from radixserve.runtime.request import ErrorCode, FinishReason
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.server import ServerConfig, create_app
from radixserve.server.errors import request_failed
from radixserve.server.testing import ServerThread
from tests.test_server_tiny import USER, assert_error, sse_events

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "Once upon a time", "hello"]


@pytest.fixture(scope="module")
def proc_engine(tiny_model_dir: Path) -> Iterator[EngineProcess]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXSERVE_CHECK_INTEGRITY", "1")  # inherited by the engine process
        engine = EngineProcess(model=str(tiny_model_dir), device="cpu", dtype="float32", max_total_tokens=4096)
    yield engine
    engine.shutdown()


def _idle(engine: EngineProcess, timeout: float = 10.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        usage = engine.check_kv()
        if usage["in_use_tokens"] == 0 and engine.num_unfinished == 0:
            return usage
        assert time.monotonic() < deadline, usage
        time.sleep(0.02)


def test_outputs_equal_the_in_process_engine(proc_engine: EngineProcess, tiny_model_dir: Path) -> None:
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    local = Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=4096)
    try:
        expected = local.generate(PROMPTS, params)
    finally:
        local.shutdown()
    got = proc_engine.generate(PROMPTS, params)
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in expected]
    assert [r["text"] for r in got] == [r["text"] for r in expected]
    again = proc_engine.generate(PROMPTS[0], params)
    assert again["meta_info"]["cached_tokens"] > 0  # the radix cache lives in the engine process
    info = proc_engine.server_info()
    assert info["model"] == str(tiny_model_dir) and info["kv_cache"]["total_tokens"] == 4096
    _idle(proc_engine)


def test_refusals_are_raised_at_once(proc_engine: EngineProcess) -> None:
    with pytest.raises(ValueError, match="out of range"):
        proc_engine.submit([10**6], SamplingParams(), lambda out: None)
    with pytest.raises(ValueError, match="temperature"):
        proc_engine.submit([1, 2, 3], SamplingParams(temperature=-1.0), lambda out: None)
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(GrammarError) as info:
        proc_engine.compile(ConstraintSpec("json_schema", schema)).result(30)
    # The error crosses the pipe whole: its kind and JSON pointer, not only its message.
    assert (info.value.kind, info.value.pointer) == ("unsupported", "/properties/tags"), info.value


def test_closing_a_stream_aborts_and_frees_kv(proc_engine: EngineProcess) -> None:
    async def read_two() -> int:
        stream = proc_engine.stream([5, 6, 7], SamplingParams(max_new_tokens=1500, ignore_eos=True))
        n = 0
        async for _ in stream:
            n += 1
            if n == 2:
                break
        await stream.aclose()
        return n

    assert asyncio.run(read_two()) == 2
    usage = _idle(proc_engine)
    assert usage["free_tokens"] + usage["evictable_tokens"] == usage["total_tokens"]


def test_the_queue_bound_holds_across_the_process_boundary(tiny_model_dir: Path) -> None:
    engine = EngineProcess(
        model=str(tiny_model_dir), device="cpu", max_total_tokens=4096, max_running_requests=1, max_queued_requests=3
    )
    try:
        params = SamplingParams(max_new_tokens=200, ignore_eos=True)
        finals: list[object] = []
        accepted = refused = 0
        for i in range(12):
            try:
                engine.submit([5 + i, 6, 7], params, lambda out: finals.append(out) if out.finished else None)
                accepted += 1
            except EngineOverloadedError as exc:
                assert "waiting queue is full" in str(exc)
                refused += 1
        assert refused > 0 and accepted <= 1 + 3 + 1, (accepted, refused)
        deadline = time.monotonic() + 60
        while len(finals) < accepted:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert engine.num_queued == 0 and engine.num_unfinished == 0
        # One the front end let through on a count one step old, and the engine refused, is an overload (429).
        refused_late = [out for out in finals if out.finish_reason == FinishReason.ERROR]  # type: ignore[attr-defined]
        assert all(out.error_code == ErrorCode.OVERLOADED for out in refused_late)  # type: ignore[attr-defined]
        assert request_failed("the waiting queue is full", ErrorCode.OVERLOADED.value).status == 429
    finally:
        engine.shutdown()


def test_a_config_mistake_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot resolve model"):
        EngineProcess(model=str(tmp_path / "nothing-here"), device="cpu")


def test_a_killed_engine_process_fails_in_flight_requests_and_is_reported(tiny_model_dir: Path) -> None:
    engine = EngineProcess(model=str(tiny_model_dir), device="cpu", max_total_tokens=4096)
    try:
        app = create_app(engine, ServerConfig(served_model_name="tiny"))
        with ServerThread(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
            body = {"model": "tiny", "messages": USER, "max_tokens": 1800, "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                os.kill(engine.pid, signal.SIGKILL)
                events = sse_events(lines)
            assert events[-1] == "[DONE]"
            assert "engine process exited" in events[-2]["error"]["message"], events[-2]
            health = http.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "dead"
            assert_error(http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER}), 503)
        with pytest.raises(EngineDeadError):
            engine.submit([1, 2], SamplingParams(), lambda out: None)
    finally:
        engine.shutdown()


def test_the_engine_process_exits_when_its_front_end_dies(tiny_model_dir: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys, time
        from radixserve.runtime.engine_process import EngineProcess
        engine = EngineProcess(model={str(tiny_model_dir)!r}, device="cpu", max_total_tokens=1024)
        print(engine.pid, flush=True)
        time.sleep(600)
        """
    )
    front = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        child = int(front.stdout.readline())  # type: ignore[union-attr]
        front.kill()
        front.wait(10)
        deadline = time.monotonic() + 20
        while _alive(child):
            assert time.monotonic() < deadline, "the engine process outlived its front end"
            time.sleep(0.1)
    finally:
        front.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_the_front_end_process_does_not_import_torch() -> None:
    """The front end only tokenizes: importing what ``radixserve serve`` runs there (the CLI, the app, the engine
    client, the tokenizer loader) must not pull in torch, whose import would compete for the cores with the engine
    process's own while both start (a cached start to ready went 4.1 -> 3.2 s on the 2-core AMD EPYC)."""
    code = textwrap.dedent(
        """
        import sys
        import radixserve.server.cli, radixserve.server.app, radixserve.runtime.engine_process
        from radixserve.runtime.weights import load_tokenizer
        print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout
