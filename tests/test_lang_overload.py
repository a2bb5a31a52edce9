"""The DSL against an engine whose queue is small: ``select`` scores its choices in batches the queue can take,
and requests refused while it is full are sent again, over HTTP and in process. (A ``select`` is one scoring
request per choice: 64 programs of 20 choices in ``run_batch`` overran the default queue of 1,024.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from radixserve.lang import EngineBackend, RuntimeEndpoint, function, select
from radixserve.lang.backend.base import Backend
from radixserve.runtime.engine import Engine
from radixserve.server import ServerConfig, create_app
from radixserve.server.testing import ServerThread

CHOICES = [f"option {i}" for i in range(12)]


@function
def pick(s, text: str) -> None:
    s += text + " The answer is" + select("choice", CHOICES)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    eng = Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=4096, max_queued_requests=4,
                 max_running_requests=2)  # fmt: skip
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("over_http", [False, True])
def test_a_batch_of_selects_fits_a_small_queue(engine: Engine, over_http: bool) -> None:
    inputs = [{"text": f"Question {i}."} for i in range(6)]
    if over_http:
        with ServerThread(create_app(engine, ServerConfig())) as srv:
            backend: Backend = RuntimeEndpoint(srv.url, timeout=120)
            assert backend.queue_bound() == 4
            states = pick.run_batch(inputs, backend=backend, num_threads=6)
    else:
        backend = EngineBackend(engine)
        states = pick.run_batch(inputs, backend=backend, num_threads=6)
    assert [s["choice"] in CHOICES for s in states] == [True] * 6
    assert engine.num_unfinished == 0


def test_select_names_the_text_it_continues_for_a_router(engine: Engine) -> None:
    """A router has no tokenizer: the scoring request (token ids) carries the program's text to route by."""
    with ServerThread(create_app(engine, ServerConfig())) as srv:
        backend = RuntimeEndpoint(srv.url)
        sent: list[dict] = []
        call = backend._call

        def spy(method: str, path: str, body: dict | None = None, stream: bool = False) -> object:
            sent.append(body or {})
            return call(method, path, body, stream)

        backend._call = spy  # type: ignore[method-assign]
        pick.run(text="Question 1.", backend=backend)
    scoring = [b for b in sent if "input_ids" in b]  # (in batches of 2: half the queue)
    assert len(scoring) == 6 and {b["routing_text"] for b in scoring} == {"Question 1. The answer is"}
