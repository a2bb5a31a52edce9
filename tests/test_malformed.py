"""Malformed and hostile input: every case gets a 4xx in OpenAI's error shape, and the server keeps serving.

Bodies: bad JSON, wrong types, out-of-range values, unknown roles, empty messages, invalid regexes and schemas,
unknown tool names, invalid token ids, non-UTF-8 bytes, bodies too large or nested too deep. Connections: a
half-sent body, half-sent headers, and connections that never send anything. After each case the server must still
answer a normal request; at the end no KV is held and the radix tree is intact.
"""

from __future__ import annotations

import gzip
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixserve.runtime.engine import Engine
from radixserve.runtime.engine_process import EngineProcess
from radixserve.server import ServerConfig, create_app
from radixserve.server.errors import APIError
from radixserve.server.params import budget
from radixserve.server.testing import ServerThread
from tests.test_server_tiny import USER, wait_idle

READ_TIMEOUT_S = 1.0
MAX_BODY = 256 * 1024
CHAT, COMP, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def _chat(**kw: Any) -> dict[str, Any]:
    return {"messages": USER, "max_tokens": 4, **kw}


def _deep(depth: int) -> bytes:
    return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"


# (id, path, body: dict -> JSON, bytes -> raw, expected status, expected param or None)
CASES: list[tuple[str, str, Any, int, str | None]] = [
    ("bad-json", CHAT, b'{"messages": [', 400, None),
    ("empty-body", CHAT, b"", 400, None),
    ("body-is-array", CHAT, b"[]", 400, None),
    ("body-is-string", CHAT, b'"hello"', 400, None),
    ("body-is-null", CHAT, b"null", 400, None),
    ("trailing-garbage", CHAT, json.dumps(_chat()).encode() + b"}}", 400, None),
    ("messages-string", CHAT, {"messages": "hi"}, 400, "messages"),
    ("messages-empty", CHAT, {"messages": []}, 400, "messages"),
    ("messages-missing", CHAT, {"max_tokens": 3}, 400, "messages"),
    ("message-no-role", CHAT, {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    ("unknown-role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("content-int", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, None),
    ("user-content-null", CHAT, {"messages": [{"role": "user", "content": None}]}, 400, "messages[0].content"),
    ("tool-no-call-id", CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id"),
    ("image-part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
    ("temperature-string", CHAT, _chat(temperature="hot"), 400, "temperature"),
    ("temperature-negative", CHAT, _chat(temperature=-1), 400, "temperature"),
    ("temperature-huge", CHAT, _chat(temperature=1e9), 400, "temperature"),
    ("top-p-zero", CHAT, _chat(top_p=0), 400, "top_p"),
    ("top-p-above-one", CHAT, _chat(top_p=1.5), 400, "top_p"),
    ("max-tokens-negative", CHAT, _chat(max_tokens=-1), 400, "max_tokens"),
    ("max-tokens-beyond-context", CHAT, _chat(max_tokens=10**7), 400, "max_tokens"),
    ("max-tokens-string", CHAT, _chat(max_tokens="ten"), 400, "max_tokens"),
    ("n-zero", CHAT, _chat(n=0), 400, "n"),
    ("n-too-many", CHAT, _chat(n=65), 400, "n"),
    ("top-logprobs-too-many", CHAT, _chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top-logprobs-without-logprobs", CHAT, _chat(top_logprobs=2), 400, "top_logprobs"),
    ("stop-too-many", CHAT, _chat(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    ("stop-too-long", CHAT, _chat(stop=["x" * 600]), 400, "stop"),
    ("stop-empty-string", CHAT, _chat(stop=[""]), 400, "stop"),
    ("stop-int", CHAT, _chat(stop=[5]), 400, None),
    ("logit-bias-key", CHAT, _chat(logit_bias={"abc": 1}), 400, "logit_bias"),
    ("logit-bias-token-range", CHAT, _chat(logit_bias={"999999": 1}), 400, "logit_bias"),
    ("logit-bias-value", CHAT, _chat(logit_bias={"5": 1000}), 400, "logit_bias"),
    ("seed-negative", CHAT, _chat(seed=-1), 400, "seed"),
    ("seed-huge", CHAT, _chat(seed=2**64), 400, "seed"),
    ("penalty-range", CHAT, _chat(presence_penalty=5), 400, "presence_penalty"),
    ("min-tokens-over-max", CHAT, _chat(min_tokens=10), 400, "min_tokens"),
    ("stop-token-ids-range", CHAT, _chat(stop_token_ids=[10**6]), 400, "stop_token_ids"),
    ("unknown-model", CHAT, _chat(model="gpt-17"), 404, "model"),
    ("invalid-regex", CHAT, _chat(regex="(unclosed"), 400, "regex"),
    ("regex-lookaround", CHAT, _chat(regex="(?=a)b"), 400, "regex"),
    ("schema-bad-type", CHAT, _chat(json_schema={"type": 42}), 400, "json_schema"),
    ("schema-unsatisfiable", CHAT, _chat(json_schema={"type": "integer", "minimum": 5, "maximum": 1}), 400, None),
    ("schema-file-ref", CHAT, _chat(json_schema={"$ref": "file:///etc/passwd"}), 400, "json_schema"),
    ("schema-remote-ref", CHAT, _chat(json_schema={"$ref": "http://127.0.0.1:9/s.json"}), 400, "json_schema"),
    ("schema-not-json", CHAT, _chat(json_schema="{not json"), 400, "json_schema"),
    ("grammar-invalid", COMP, {"prompt": "x", "ebnf": "root ::= ("}, 400, "ebnf"),
    ("choices-empty", COMP, {"prompt": "x", "choices": []}, 400, "choices"),
    ("two-constraints", CHAT, _chat(regex="a+", choices=["a"]), 400, None),
    ("response-format-no-schema", CHAT, _chat(response_format={"type": "json_schema"}), 400, "response_format"),
    ("response-format-type", CHAT, _chat(response_format={"type": "yaml"}), 400, None),
    ("unknown-tool-choice", CHAT, _chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}),
     400, "tool_choice"),
    ("tool-choice-without-tools", CHAT, _chat(tool_choice="required"), 400, "tool_choice"),
    ("tool-without-name", CHAT, _chat(tools=[{"type": "function", "function": {"parameters": {}}}]), 400, None),
    ("tool-choice-bad-string", CHAT, _chat(tools=[TOOL], tool_choice="sometimes"), 400, None),
    ("tool-parameters-not-object", CHAT, _chat(tools=[{"type": "function", "function": {"name": "f",
     "parameters": {"type": "string"}}}]), 400, "tools[0].function.parameters"),  # fmt: skip
    ("chat-template-kwargs-type", CHAT, _chat(chat_template_kwargs=[1, 2]), 400, None),
    ("prompt-empty-list", COMP, {"prompt": []}, 400, "prompt"),
    ("prompt-empty-ids", COMP, {"prompt": [[]]}, 400, "prompt"),
    ("prompt-token-out-of-range", COMP, {"prompt": [999999], "max_tokens": 2}, 400, "prompt"),
    ("prompt-token-negative", COMP, {"prompt": [[5, -3]], "max_tokens": 2}, 400, "prompt"),
    ("prompt-object", COMP, {"prompt": {"a": 1}}, 400, "prompt"),
    ("prompt-too-long", COMP, {"prompt": [5] * 300, "max_tokens": 1}, 400, "prompt"),
    ("suffix", COMP, {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("best-of", COMP, {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("generate-both", GEN, {"text": "x", "input_ids": [5]}, 400, "text"),
    ("generate-neither", GEN, {}, 400, "text"),
    ("generate-unknown-param", GEN, {"text": "x", "sampling_params": {"temprature": 0}}, 400, None),
    ("generate-param-type", GEN, {"text": "x", "sampling_params": {"temperature": "x"}}, 400, "sampling_params"),
    ("generate-ids-range", GEN, {"input_ids": [10**7]}, 400, None),
    ("generate-rid-count", GEN, {"text": ["a", "b"], "rid": ["r1"]}, 400, "rid"),
    ("generate-duplicate-rid", GEN, {"text": ["a", "b"], "rid": ["dup", "dup"]}, 409, "rid"),
    ("abort-nothing", "/abort_request", {}, 400, "rid"),
    ("abort-unknown", "/abort_request", {"rid": "no-such-request"}, 404, "rid"),
    ("tokenize-neither", "/tokenize", {}, 400, "prompt"),
    ("detokenize-out-of-range", "/detokenize", {"tokens": [5, 10**7]}, 400, "tokens"),
    ("detokenize-not-ids", "/detokenize", {"tokens": "hello"}, 400, "tokens"),
    ("non-utf8", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3"}]}', 400, None),
    # Lone surrogate escapes are valid JSON but not Unicode: they once reached the tokenizer (500) or the response.
    ("lone-surrogate-chat", CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, None),
    ("lone-surrogate-rid", GEN, b'{"text": "hi", "rid": "\\udfff", "sampling_params": {"max_new_tokens": 1}}', 400,
     None),
    ("generate-logit-bias-list", GEN, {"text": "x", "sampling_params": {"logit_bias": [1, 2]}}, 400, None),
    ("repetition-penalty-huge", COMP, {"prompt": "x", "max_tokens": 2, "repetition_penalty": 1e300}, 400, None),
    ("nested-too-deep", CHAT, _deep(5000), 400, None),
    ("nested-just-too-deep", CHAT, _deep(64), 400, None),
    ("body-too-large", CHAT, json.dumps(_chat(stop=["x" * (MAX_BODY + 10)])).encode(), 413, None),
]


@pytest.fixture(scope="module", params=["engine-thread", "engine-process"])
def served(tiny_model_dir: Path, request: pytest.FixtureRequest) -> Iterator[tuple[ServerThread, Engine]]:
    engine_class = Engine if request.param == "engine-thread" else EngineProcess
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXSERVE_CHECK_INTEGRITY", "1")
        engine = engine_class(model=str(tiny_model_dir), device="cpu", max_total_tokens=2048, max_context_len=256)
    config = ServerConfig(served_model_name="tiny", max_body_bytes=MAX_BODY, request_read_timeout=READ_TIMEOUT_S)
    try:
        with ServerThread(create_app(engine, config)) as srv:
            yield srv, engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def http(served: tuple[ServerThread, Engine]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served[0].url, timeout=30) as client:
        yield client


def _assert_openai_error(resp: httpx.Response, status: int, param: str | None) -> None:
    assert resp.status_code == status, resp.text[:500]
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err


def _still_serves(http: httpx.Client) -> None:
    resp = http.post(CHAT, json=_chat())
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(("path", "body", "status", "param"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_body(http: httpx.Client, path: str, body: Any, status: int, param: str | None) -> None:
    if isinstance(body, bytes):
        resp = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        resp = http.post(path, json=body)
    _assert_openai_error(resp, status, param)
    _still_serves(http)


def test_wrong_method_and_path(http: httpx.Client) -> None:
    _assert_openai_error(http.get(CHAT), 405, None)
    _assert_openai_error(http.post("/v1/no/such/route", json={}), 404, None)
    _still_serves(http)


def test_chunked_body_too_large(http: httpx.Client) -> None:
    """A body without Content-Length is cut off as soon as it passes the limit."""

    def chunks() -> Iterator[bytes]:
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(MAX_BODY // 4096 + 4):
            yield b"x" * 4096
        yield b'"}]}'

    resp = http.post(CHAT, content=chunks(), headers={"Content-Type": "application/json"})
    _assert_openai_error(resp, 413, None)
    assert f"more than {MAX_BODY} bytes" in resp.json()["error"]["message"]
    # On the Messages API the limits answer in Anthropic's shape, as its other errors do.
    resp = http.post("/v1/messages", content=b"x" * (MAX_BODY + 1), headers={"Content-Type": "application/json"})
    assert resp.status_code == 413 and resp.json()["type"] == "error", resp.text
    assert resp.json()["error"]["type"] == "request_too_large"
    deep = http.post("/v1/messages", content=b"[" * 100 + b"]" * 100, headers={"Content-Type": "application/json"})
    assert deep.status_code == 400 and deep.json()["error"]["type"] == "invalid_request_error", deep.text
    gzipped = http.post(CHAT, content=gzip.compress(b"{}"), headers={"Content-Encoding": "gzip"})
    _assert_openai_error(gzipped, 415, None)
    assert "Content-Encoding 'gzip'" in gzipped.json()["error"]["message"]
    _still_serves(http)


def _raw(port: int, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=READ_TIMEOUT_S + 10)
    if data:
        sock.sendall(data)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        out += chunk
    sock.close()
    return out


def _status_and_error(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)["error"]


def test_slow_and_idle_connections(served: tuple[ServerThread, Engine], http: httpx.Client) -> None:
    """A half-sent body and half-sent headers get 408 after --request-read-timeout; a connection that never sends
    a byte is closed; meanwhile, and afterwards, other clients are served."""
    port = served[0].port
    head = f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n".encode()
    half_body = _raw(port, head + b"Content-Length: 500\r\n\r\n" + b'{"messages": [')
    half_head = _raw(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0")
    idle = [_raw(port, b"") for _ in range(20)]
    _still_serves(http)  # not held up by any of them
    start = time.monotonic()
    status, err = _status_and_error(_read_all(half_body))
    assert status == 408 and err["code"] == "request_timeout" and set(err) == {"message", "type", "param", "code"}
    status, err = _status_and_error(_read_all(half_head))
    assert status == 408 and "headers" in err["message"]
    for sock in idle:
        assert _read_all(sock) == b""  # closed without a response
    assert time.monotonic() - start < READ_TIMEOUT_S + 10
    # A new client, as a user arriving now would be: the fixture's pooled connection has been idle for as long as
    # the slow ones took, and the server may close an idle keep-alive connection just as a request goes out on it.
    with httpx.Client(base_url=http.base_url, timeout=http.timeout) as fresh:
        _still_serves(fresh)


def test_nothing_leaked(served: tuple[ServerThread, Engine], http: httpx.Client) -> None:
    info = wait_idle(http)
    assert info["num_inflight_requests"] == 0
    engine = served[1]
    engine.check_kv()
    assert http.get("/health").json() == {"status": "ready"}


def test_budget_names_the_prompt_when_the_kv_pool_is_the_limit() -> None:
    """Context 2,048 but a KV pool of 256 tokens: a 300-token prompt cannot fit whatever max_tokens says."""
    for requested in (None, 5):
        with pytest.raises(APIError) as info:
            budget(requested, 300, 2048, 256, "prompt")
        assert info.value.param == "prompt" and "KV cache" in info.value.message
    assert budget(None, 100, 2048, 256, "prompt") == 156 and budget(5, 100, 2048, 256, "prompt") == 5
