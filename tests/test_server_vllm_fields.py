"""Fields that clients written for vLLM send: honoured where they map onto what the server does, a 400 naming
them where ignoring them would change the output, a log line for the rest. Never a silent 200 with output that
ignores the request's constraint."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from radixserve.runtime.engine import Engine
from radixserve.server import ServerConfig, create_app
from radixserve.server.testing import ServerThread
from tests.test_server_tiny import MODEL, USER, assert_error

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    engine = Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=4096)
    try:
        with ServerThread(create_app(engine, ServerConfig(served_model_name=MODEL))) as srv:
            yield srv
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _digits(text: str) -> bool:
    return re.fullmatch(r"[0-9]{3}", text) is not None


def _yes_no(text: str) -> bool:
    return text in ("yes", "no")


def _json_n(text: str) -> bool:
    value = json.loads(text)
    return isinstance(value, dict) and set(value) == {"n"} and isinstance(value["n"], int)


def _object(text: str) -> bool:
    return isinstance(json.loads(text), dict)


CASES = [
    ({"guided_regex": "[0-9]{3}"}, _digits),
    ({"guided_choice": ["yes", "no"]}, _yes_no),
    ({"guided_json": SCHEMA}, _json_n),
    ({"guided_json": json.dumps(SCHEMA)}, _json_n),
    ({"guided_grammar": 'start: "yes" | "no"'}, _yes_no),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, _digits),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, _yes_no),
    ({"structured_outputs": {"json": SCHEMA}}, _json_n),
    ({"structured_outputs": {"grammar": 'start: "yes" | "no"'}}, _yes_no),
    ({"structured_outputs": {"json_object": True}}, _object),
]


@pytest.mark.parametrize(("extra", "check"), CASES, ids=[json.dumps(c[0])[:48] for c in CASES])
def test_vllm_constraint_fields_are_enforced(client: openai.OpenAI, extra: dict[str, Any], check: Any) -> None:
    finished = 0
    # 24 answers: a random model closes a free-form JSON object within 40 tokens about one time in three (7 and 8
    # of 24, with both samplers this project has had), the other constraints nearly always.
    for seed in range(1, 13):
        chat = client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=40, temperature=1.0, seed=seed, extra_body=extra
        )
        text = client.completions.create(
            model=MODEL, prompt="Answer:", max_tokens=40, temperature=1.0, seed=seed, extra_body=extra
        )
        # A random model may ramble inside a JSON value until max_tokens; a finished answer must obey.
        for reason, output in (
            (chat.choices[0].finish_reason, chat.choices[0].message.content),
            (text.choices[0].finish_reason, text.choices[0].text),
        ):
            if reason == "stop":
                assert check(output), output
                finished += 1
    assert finished >= 3, "the constraint should finish most answers"


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"guided_regex": "[0-9", "max_tokens": 4}, "guided_regex", "invalid_constraint"),
        ({"guided_regex": "a", "regex": "b"}, "guided_regex", "conflicting_constraints"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs.choice",
            "conflicting_constraints",
        ),
        ({"structured_outputs": {"structural_tag": {"x": 1}}}, "structured_outputs.structural_tag", None),
        ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp", None),
        ({"use_beam_search": True}, "use_beam_search", "unsupported_parameter"),
        ({"best_of": 2}, "best_of", "unsupported_parameter"),
        ({"echo": True}, "echo", "unsupported_parameter"),
        ({"chat_template": "{{ messages }}"}, "chat_template", "unsupported_parameter"),
    ],
)
def test_fields_that_would_change_the_output_are_refused(
    http: httpx.Client, extra: dict[str, Any], param: str, code: str | None
) -> None:
    body = {"model": MODEL, "messages": USER, "max_tokens": 4, **extra}
    err = assert_error(http.post("/v1/chat/completions", json=body), 400, param=param)
    if code is not None:
        assert err["code"] == code, err


def test_harmless_and_unknown_fields_are_served_and_the_unknown_logged(
    http: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    body = {
        "model": MODEL,
        "messages": USER,
        "max_tokens": 4,
        "user": "u1",  # known, harmless: quiet
        "use_beam_search": False,  # what the server does anyway
        "add_generation_prompt": True,
        "frobnicate_level": 3,  # unknown: served, and logged
    }
    with caplog.at_level(logging.DEBUG, logger="radixserve.server"):
        resp = http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        resp = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "frobnicate_level": 3}
        )
        assert resp.status_code == 200, resp.text
    lines = [r.getMessage() for r in caplog.records if "ignoring unknown field" in r.getMessage()]
    assert any("/v1/chat/completions" in line and "frobnicate_level" in line for line in lines), lines
    assert not any("user" in line.split("field(s)")[1] for line in lines), lines
    warnings = [r for r in caplog.records if "frobnicate_level" in r.getMessage() and r.levelno >= logging.WARNING]
    assert len(warnings) == 1, "an unknown field is a warning once, then a debug line"


def test_priority_needs_the_priority_policy(http: httpx.Client) -> None:
    """As vLLM: a priority that nothing would read is refused (this server runs the default policy); 0 is fine."""
    body = {"model": MODEL, "messages": USER, "max_tokens": 2}
    assert http.post("/v1/chat/completions", json={**body, "priority": 0}).status_code == 200
    err = assert_error(http.post("/v1/chat/completions", json={**body, "priority": 3}), 400, param="priority")
    assert "--schedule-policy priority" in err["message"]
    responses = {"model": MODEL, "input": "hi", "max_output_tokens": 2, "priority": 3}
    assert_error(http.post("/v1/responses", json=responses), 400, param="priority")
    messages = {"model": MODEL, "messages": USER, "max_tokens": 2, "priority": 3}
    resp = http.post("/v1/messages", json=messages)
    assert resp.status_code == 400 and "--schedule-policy priority" in resp.json()["error"]["message"]


def test_priority_is_served_with_the_priority_policy(tiny_model_dir: Path) -> None:
    engine = Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=2048, schedule_policy="priority")
    try:
        with ServerThread(create_app(engine, ServerConfig(served_model_name=MODEL))) as srv:
            for path, body in (
                ("/v1/chat/completions", {"messages": USER}),
                ("/v1/completions", {"prompt": "hi"}),
                ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
            ):
                resp = httpx.post(srv.url + path, json={"model": MODEL, "max_tokens": 2, "priority": -2, **body})
                assert resp.status_code == 200, (path, resp.text)
    finally:
        engine.shutdown()


def test_continuous_usage_stats(client: openai.OpenAI) -> None:
    """vLLM's stream_options.continuous_usage_stats: every chunk counts its choice's tokens so far."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, stream=True, stream_options=options,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    )
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert counts == sorted(counts) and counts[-1] == 6 and len(counts) >= 2
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices  # the final usage chunk, as before
    text = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True, stream_options=options,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    counts = [c.usage.completion_tokens for c in text if c.choices and c.usage is not None]
    assert counts[-1] == 4 and counts == sorted(counts)
