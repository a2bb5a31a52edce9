"""Property-based API fuzzing: schemathesis generates requests for every operation in /openapi.json, both valid
ones (positive) and ones that break the schema (negative), and sends them over loopback. No request may get a
5xx; afterwards the server still serves, holds no KV and its radix tree is intact.

Bounded: a fixed number of examples per operation, derandomized (the same cases on every run), and an engine with
a 64-token context so that no generated request can run long.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from radixserve.runtime.engine import Engine
from radixserve.server import ServerConfig, create_app
from radixserve.server.testing import ServerThread
from tests.test_server_tiny import wait_idle

GENERATION_EXAMPLES = 80  # per mode, for the routes that generate
OTHER_EXAMPLES = 20


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[tuple[ServerThread, Engine]]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXSERVE_CHECK_INTEGRITY", "1")
        engine = Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=2048, max_context_len=64)
    try:
        with ServerThread(create_app(engine, ServerConfig(served_model_name="tiny"))) as srv:
            yield srv, engine
    finally:
        engine.shutdown()


def _fuzz(operation: Any, mode: GenerationMode, base_url: str, statuses: Counter, failures: list[str]) -> None:
    generates = operation.method.upper() == "POST" and operation.path in (
        "/v1/chat/completions",
        "/v1/completions",
        "/generate",
    )

    @settings(
        max_examples=GENERATION_EXAMPLES if generates else OTHER_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        resp = case.call(base_url=base_url, timeout=120)
        statuses[resp.status_code] += 1
        # A stream reports a failure after its 200 headers as an error event.
        streamed_error = "event-stream" in resp.headers.get("content-type", "") and '"server_error"' in resp.text
        if resp.status_code >= 500 or streamed_error:
            failures.append(f"{operation.label} ({mode.value}): {resp.status_code} {resp.text[:300]} for {case!r}")

    with contextlib.suppress(Unsatisfiable):  # nothing to break in an operation without parameters or body
        run()


def test_fuzz_openapi_no_5xx(served: tuple[ServerThread, Engine]) -> None:
    srv, engine = served
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        schema = schemathesis.openapi.from_dict(http.get("/openapi.json").json())
        operations = [result.ok() for result in schema.get_all_operations()]
        labels = {op.label for op in operations}
        assert labels >= {"POST /v1/chat/completions", "POST /v1/completions", "POST /generate"}
        statuses: Counter[int] = Counter()
        failures: list[str] = []
        for operation in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                _fuzz(operation, mode, srv.url, statuses, failures)
        assert not failures, f"{len(failures)} requests got a 5xx:\n" + "\n".join(failures[:5])
        assert statuses[200] > 0 and sum(n for s, n in statuses.items() if 400 <= s < 500) > 0, statuses
        print(f"\nfuzz: {sum(statuses.values())} requests over {len(operations)} operations, statuses {dict(statuses)}")
        wait_idle(http)
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    engine.call(lambda core: core.cache.check(core.scheduler.holders()))
