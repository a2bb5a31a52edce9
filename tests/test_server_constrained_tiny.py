"""Constrained decoding through every route over the tiny random model: each field is wired through, errors are
OpenAI-shaped 400s naming the field, forced tool calls come back as ``tool_calls``.

The tiny model's byte-level BPE tokenizer carries a grammar vocabulary (``TokenizerInfo.from_hf`` accepts it), so
constraints are served here; whether real outputs are sensible is checked over the real model in
tests/test_server_constrained.py. A random model may ramble inside a JSON string until max_tokens, so outputs are
checked unless the answer was cut ("length").
"""

from __future__ import annotations

import json
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


def _is_json(text: str) -> bool:
    json.loads(text)  # raises on anything else
    return True


def _is_object(text: str) -> bool:
    return isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    ("path", "extra", "check"),
    [
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, _is_object),
        ("/v1/chat/completions", {"regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t)),
        ("/v1/chat/completions", {"json_schema": {"enum": [1, 2]}}, lambda t: json.loads(t) in (1, 2)),
        ("/v1/completions", {"json_schema": True}, _is_json),  # the schema that accepts any JSON value
        ("/v1/completions", {"ebnf": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
        ("/v1/completions", {"grammar": 'start: "a" "b"+'}, lambda t: re.fullmatch("ab+", t)),
        ("/v1/completions", {"choices": ["red", "green"]}, lambda t: t in ("red", "green")),
        ("/v1/completions", {"response_format": {"type": "json_object"}}, _is_object),
        ("/generate", {"sampling_params": {"regex": "a+b", "max_new_tokens": 16}}, lambda t: re.fullmatch("a+b", t)),
    ],
)
def test_constrained_params_served(http: httpx.Client, path: str, extra: dict, check: Any) -> None:
    body = {"/v1/chat/completions": {"messages": USER}, "/v1/completions": {"prompt": "x"}}.get(path, {"text": "x"})
    resp = http.post(path, json={"max_tokens": 64, "temperature": 0, **body, **extra})
    assert resp.status_code == 200, resp.text
    out = resp.json()
    if path == "/generate":
        text, reason = out["text"], out["meta_info"]["finish_reason"]["type"]
    else:
        choice = out["choices"][0]
        text, reason = choice.get("text", (choice.get("message") or {}).get("content")), choice["finish_reason"]
    assert reason == "length" or check(text), text


@pytest.mark.parametrize(
    ("path", "extra", "param", "code"),
    [
        ("/v1/chat/completions", {"regex": "[0-9"}, "regex", "invalid_constraint"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format", None),
        ("/v1/chat/completions", {"json_schema": {"type": 5}}, "json_schema", "invalid_constraint"),
        ("/v1/completions", {"json_schema": "{not json"}, "json_schema", "invalid_constraint"),
        ("/v1/completions", {"choices": []}, "choices", "invalid_constraint"),
        ("/v1/completions", {"ebnf": "root ::= ["}, "ebnf", "invalid_constraint"),
        ("/generate", {"sampling_params": {"regex": "a("}}, "sampling_params.regex", "invalid_constraint"),
        ("/generate", {"sampling_params": {"regex": "a", "choices": ["a"]}}, "sampling_params.choices", "conflicting"),
        ("/v1/completions", {"regex": "a", "json_schema": {}}, "regex", "conflicting_constraints"),
        ("/v1/chat/completions", {"regex": "a", "response_format": {"type": "json_object"}}, None, "conflicting"),
        ("/v1/completions", {"ebnf": "start: start"}, "ebnf", "invalid_constraint"),
        ("/v1/completions", {"json_schema": {"$ref": "#"}}, "json_schema", "invalid_constraint"),
        ("/generate", {"sampling_params": {"regex": "(a{1000}){1000}"}}, "sampling_params.regex", "constraint_too"),
        # Numbers the grammar backend cannot hold: once an internal error (500), and a wrongly forced value.
        ("/v1/completions", {"json_schema": {"type": "integer", "minimum": 10**30}}, "json_schema", "constraint_too"),
        ("/v1/completions", {"json_schema": {"const": 2**55 + 1}}, "json_schema", "unsupported_constraint"),
        # llguidance panicked on this one (tiny model's tokenizer) and its Rust backtrace reached the message.
        ("/v1/completions", {"ebnf": 'start: <|im_end|> | "a"'}, "ebnf", "invalid_constraint"),
    ],
)
def test_constraint_errors(http: httpx.Client, path: str, extra: dict, param: str | None, code: Any) -> None:
    body = {"/v1/chat/completions": {"messages": USER}, "/v1/completions": {"prompt": "x"}}.get(path, {"text": "x"})
    err = assert_error(http.post(path, json={**body, **extra}), 400, param=param)
    assert "backtrace" not in err["message"] and len(err["message"]) < 2000, err["message"]
    if code is not None:
        assert err["code"].startswith(code)
    if code and code.startswith("conflicting"):  # the message names both fields
        assert all(name in err["message"] for name in extra.get("sampling_params", extra))


def test_tool_choice_forced(http: httpx.Client, client: openai.OpenAI) -> None:
    tools = [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]
    for choice in ("required", {"type": "function", "function": {"name": "g"}}):
        kw = dict(model=MODEL, messages=USER, tools=tools, max_tokens=32)
        resp = client.chat.completions.create(**kw, tool_choice=choice)
        msg, reason = resp.choices[0].message, resp.choices[0].finish_reason
        assert reason == "tool_calls" and msg.content is None and len(msg.tool_calls) == 1
        call = msg.tool_calls[0]
        assert call.id.startswith("call_") and call.type == "function" and call.function.arguments == "{}"
        assert call.function.name in (["g"] if isinstance(choice, dict) else ["f", "g"])
    # Several calls only when asked for; cut by max_tokens, the calls so far come back with "length".
    resp = client.chat.completions.create(**kw, tool_choice="required", parallel_tool_calls=True)
    calls, reason = resp.choices[0].message.tool_calls, resp.choices[0].finish_reason
    assert calls and reason in ("tool_calls", "length")
    assert all(c.function.name in ("f", "g") and "{}".startswith(c.function.arguments) for c in calls)
    named = {"type": "function", "function": {"name": "nope"}}
    body = {"messages": USER, "tools": tools}
    assert_error(http.post("/v1/chat/completions", json={**body, "tool_choice": named}), 400, param="tool_choice")
    no_tools = {"messages": USER, "tool_choice": "required"}
    assert_error(http.post("/v1/chat/completions", json=no_tools), 400, param="tool_choice")
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minProperties": "x"}}}]
    err = assert_error(
        http.post("/v1/chat/completions", json={"messages": USER, "tools": bad, "tool_choice": "required"}), 400
    )
    assert err["param"] == "tools[0].function.parameters" and "minProperties" in err["message"]
    metrics = http.get("/metrics").text
    assert "radixserve:num_requests_waiting_grammar{" in metrics and 'stat="hits"' in metrics


def test_parallel_tool_calls_false_returns_one_call(client: openai.OpenAI) -> None:
    """Under "auto" the model wrote two calls (forced here by a regex): with ``parallel_tool_calls: false`` only
    the first comes back, streamed or not, as OpenAI promises."""
    tools = [{"type": "function", "function": {"name": n}} for n in ("f", "g")]
    two = '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    kw = dict(model=MODEL, messages=USER, tools=tools, max_tokens=200, extra_body={"regex": re.escape(two)})
    assert [c.function.name for c in client.chat.completions.create(**kw).choices[0].message.tool_calls] == ["f", "g"]
    one = client.chat.completions.create(**kw, parallel_tool_calls=False).choices[0]
    assert [c.function.name for c in one.message.tool_calls] == ["f"] and one.finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(**kw, parallel_tool_calls=False, stream=True))
    streamed = [t.function.name for c in chunks if c.choices and c.choices[0].delta.tool_calls
                for t in c.choices[0].delta.tool_calls if t.function.name]  # fmt: skip
    assert streamed == ["f"]


@pytest.mark.parametrize("stream", [False, True])
def test_grammar_failing_while_decoding_is_a_client_error(http: httpx.Client, stream: bool) -> None:
    r"""This regex passes the compile-time probe and blows the lexer's limit after its ``[bc]`` head: a 400 naming
    the cause (an error event when streaming), never a 500; the server keeps serving. (Python's ``re`` cannot
    parse ``\p{Greek}``, so the submit-time check of forced stretches lets it through to llguidance.)"""
    regex = r"[bc]{12}(a{1000}){1000}(\p{Greek})?"
    body = {"prompt": "x", "max_tokens": 40, "temperature": 0, "regex": regex, "stream": stream}
    if not stream:
        err = assert_error(http.post("/v1/completions", json=body), 400)
        assert err["code"] == "grammar_error" and "too many expressions" in err["message"]
    else:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            events = [line for line in resp.iter_lines() if line.startswith("data: ")]
        error = json.loads(events[-2][len("data: ") :])["error"]
        assert error["code"] == "grammar_error" and events[-1] == "data: [DONE]"
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
