"""The HTTP server over the tiny random model: real engine, real HTTP on 127.0.0.1, the official openai SDK."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from radixserve.runtime.engine import Engine
from radixserve.server import ServerConfig, create_app
from radixserve.server.testing import ServerThread

MODEL = "tiny"
USER = [{"role": "user", "content": "What is the capital of France?"}]
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. A serving engine keeps many requests in flight. " * 6


@pytest.fixture(scope="session")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXSERVE_CHECK_INTEGRITY", "1")
        eng = Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=4096)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def server(engine: Engine) -> Iterator[ServerThread]:
    with ServerThread(create_app(engine, ServerConfig(served_model_name=MODEL))) as srv:
        yield srv


@pytest.fixture(scope="session")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="session")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def sse_events(lines: Iterator[str]) -> list[dict | str]:
    events: list[dict | str] = []
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(resp: httpx.Response, status: int, *, param: str | None = None, text: str = "") -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert text in err["message"]
    if param is not None:
        assert err["param"] == param
    return err


def wait_idle(http: httpx.Client, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = http.get("/server_info").json()
        busy = info["num_running_requests"] + info["num_waiting_requests"] + info["kv_cache"]["in_use_tokens"]
        if busy == 0:
            return info
        assert time.monotonic() < deadline, info
        time.sleep(0.05)


def abort_count(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("radixserve:request_success_total{") and 'finished_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# --- OpenAI routes --------------------------------------------------------------------------------------------
def test_health_models_openapi(http: httpx.Client, client: openai.OpenAI, engine: Engine) -> None:
    assert http.get("/health").json() == {"status": "ready"}
    head = http.head("/health")  # load balancers that probe with HEAD
    assert head.status_code == 200 and head.content == b""
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    schema = http.get("/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/generate", "/health", "/metrics"):
        assert path in schema["paths"]
    assert "ChatCompletionRequest" in schema["components"]["schemas"]


def test_chat_plain_and_usage(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, temperature=0)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.model == MODEL
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = resp.usage
    assert usage.completion_tokens <= 8 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # The spec's model string is accepted too, and so is a system message with text parts.
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, *USER]
    again = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=4, temperature=0)
    assert again.usage.completion_tokens <= 4


def test_chat_stream_equals_plain(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=USER, max_tokens=12, temperature=0)
    plain = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_completions_plain_stream_and_batch(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="def add(a, b):", max_tokens=10, temperature=0)
    plain = client.completions.create(**kw)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert streamed == plain.choices[0].text
    assert plain.usage.completion_tokens <= 10
    batch = client.completions.create(model=MODEL, prompt=["hello", "def add(a, b):"], max_tokens=10, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[1].text == plain.choices[0].text
    by_ids = client.completions.create(model=MODEL, prompt=[[5, 6, 7]], max_tokens=3, temperature=0)
    assert by_ids.usage.prompt_tokens == 3
    default = client.completions.create(model=MODEL, prompt="hello", extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens for completions


def test_n_and_seeds(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=USER, max_tokens=8, temperature=1.0, n=3, seed=11)
    first = client.chat.completions.create(**kw)
    second = client.chat.completions.create(**kw)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in second.choices]
    assert len(set(texts)) > 1  # seed + i per choice: the choices differ
    other = client.chat.completions.create(**{**kw, "seed": 12, "n": 1})
    assert other.choices[0].message.content == texts[1]  # choice 1 used seed 12
    assert first.usage.prompt_tokens == other.usage.prompt_tokens  # counted once for n choices


def test_streams_with_n_and_echo(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=USER, max_tokens=6, temperature=1.0, n=2, seed=5)
    plain = client.chat.completions.create(**kw)
    chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == plain.choices[i].finish_reason
        assert "".join(c.delta.content or "" for c in mine) == plain.choices[i].message.content
    echoed = list(client.completions.create(model=MODEL, prompt="hello", max_tokens=3, echo=True, stream=True))
    assert echoed[0].choices[0].text == "hello"
    assert "".join(c.choices[0].text for c in echoed).startswith("hello")


def test_stop_and_extra_params(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    stop = full[6:9]
    cut = client.completions.create(**kw, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    extras = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 4, "ignore_eos": True}
    out = client.completions.create(
        model=MODEL,
        prompt="hi",
        max_tokens=6,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"5": 1.0},
        seed=1,
        extra_body=extras,
    )
    assert out.usage.completion_tokens == 6


def test_chat_logprobs(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs), abs=1e-5)  # greedy
    assert "".join(e.token for e in content) == resp.choices[0].message.content
    # Streamed: each delta carries its tokens' logprobs, and the stream still ends with finish_reason and usage.
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, temperature=0,
                                                 logprobs=True, stream=True, stream_options={"include_usage": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == resp.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens


def test_completions_echo_logprobs(client: openai.OpenAI) -> None:
    prompt = "The quick brown fox jumps"
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    choice = scored.choices[0]
    assert choice.text == prompt
    lp = choice.logprobs
    assert len(lp.tokens) == scored.usage.prompt_tokens == len(lp.token_logprobs)
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == prompt and lp.text_offset[0] == 0
    more = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=1, temperature=0)
    assert more.choices[0].text.startswith(prompt)
    assert len(more.choices[0].logprobs.tokens) == more.usage.prompt_tokens + more.usage.completion_tokens
    assert more.choices[0].logprobs.token_logprobs[1:4] == pytest.approx(lp.token_logprobs[1:4], abs=1e-4)


def test_cached_tokens_on_repeat(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": LONG_PROMPT}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= second.usage.prompt_tokens


def test_tools_auto_and_tool_messages(client: openai.OpenAI, http: httpx.Client) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    # A template that cannot render calls (this one): each result names the call it answers.
    prompt = http.post("/tokenize", json={"messages": messages}).json()["prompt"]
    assert 'get_weather({"city": "Paris"}) returned:\nsunny' in prompt
    with_tools = http.post("/tokenize", json={"messages": messages, "tools": tools}).json()["prompt"]
    assert "You may call" in with_tools and "You may call" not in prompt  # the tools render as chat renders them
    for choice in ("auto", "none"):
        resp = client.chat.completions.create(
            model=MODEL, messages=messages, tools=tools, tool_choice=choice, max_tokens=6, temperature=0
        )
        # The random model does not call tools; the answer is content either way.
        msg = resp.choices[0].message
        assert (msg.tool_calls and resp.choices[0].finish_reason == "tool_calls") or isinstance(msg.content, str)
    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, max_tokens=6, temperature=0, stream=True
    )
    assert [c for c in streamed if c.choices and c.choices[0].finish_reason]


# --- errors ---------------------------------------------------------------------------------------------------
def test_error_shapes(http: httpx.Client, client: openai.OpenAI) -> None:
    chat = "/v1/chat/completions"
    bad = http.post(chat, content=b'{"messages": [', headers={"Content-Type": "application/json"})
    assert_error(bad, 400, text="not valid JSON")
    assert_error(http.post(chat, json={"messages": USER, "temperature": "hot"}), 400, param="temperature")
    assert_error(http.post(chat, json={"messages": "hi"}), 400, param="messages")
    assert_error(http.post(chat, json={"model": "gpt-4", "messages": USER}), 404, param="model")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=USER)
    err = assert_error(http.post(chat, json={"messages": [{"role": "wizard", "content": "x"}]}), 400)
    assert err["param"] == "messages[0].role" and "wizard" in err["message"]
    assert_error(http.post(chat, json={"messages": []}), 400, param="messages")
    assert_error(http.post(chat, json={"messages": USER, "top_p": 0}), 400, param="top_p")
    assert_error(http.post(chat, json={"messages": USER, "max_tokens": 10**7}), 400, param="max_tokens")
    assert_error(http.post(chat, json={"messages": USER, "n": 0}), 400, param="n")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert_error(http.post(chat, json={"messages": image}), 400, text="text-only")
    too_long = http.post("/v1/completions", json={"prompt": [5] * 2100, "max_tokens": 1})
    assert_error(too_long, 400, param="prompt", text="context length")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", logit_bias={"999999": 1.0})
    # Unknown fields are ignored.
    ok = http.post(chat, json={"messages": USER, "max_tokens": 1, "store": True, "metadata": {"a": "b"}, "user": "u"})
    assert ok.status_code == 200


def test_api_key(engine: Engine) -> None:
    app = create_app(engine, ServerConfig(api_key="sekret"))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url) as http:
        assert http.get("/health").status_code == 200
        assert_error(http.get("/v1/models"), 401)
        assert_error(http.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert_error(http.post("/generate", json={"text": "x"}), 401)
        assert http.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        sdk = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
        assert sdk.completions.create(model=engine.model_name, prompt="hi", max_tokens=2).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="bad", max_retries=0).models.list()


def test_health_503_while_loading(tiny_model_dir: Path) -> None:
    release = threading.Event()

    def factory() -> Engine:
        release.wait(30)
        return Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=1024)

    app = create_app(factory, ServerConfig(), model=str(tiny_model_dir))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url) as http:
        assert http.get("/health").status_code == 503 and http.post("/ping").status_code == 503
        assert_error(http.post("/v1/completions", json={"prompt": "x"}), 503)
        release.set()
        deadline = time.monotonic() + 20
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert not app.state.server.engine.alive  # the app built the engine, so it shut it down


def test_overload_engine_failure_and_death(tiny_model_dir: Path) -> None:
    """429 with Retry-After when the queue is full, 500 naming the cause when the engine fails a request (and
    only that request), 503 once the engine is gone."""
    eng = Engine(
        model=str(tiny_model_dir), device="cpu", max_total_tokens=1024, max_running_requests=1, max_queued_requests=1
    )
    try:
        with ServerThread(create_app(eng, ServerConfig())) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
            body = {"messages": USER, "max_tokens": 4, "n": 3}
            resp = http.post("/v1/chat/completions", json=body)
            assert_error(resp, 429)
            assert resp.headers["Retry-After"] == "1"
            wait_idle(http)  # the two accepted choices were aborted with the refused one

            real_run = eng.core.runner.run

            def failing_run(plan):
                raise RuntimeError("simulated device fault")

            eng.core.runner.run = failing_run
            try:
                err = assert_error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}), 500)
                assert "simulated device fault" in err["message"]
                with http.stream("POST", "/v1/chat/completions", json={**body, "n": 1, "stream": True}) as r:
                    events = sse_events(r.iter_lines())
                assert events[-1] == "[DONE]" and "simulated device fault" in events[-2]["error"]["message"]
            finally:
                eng.core.runner.run = real_run
            assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
            eng.shutdown()
            assert http.get("/health").status_code == 503
            assert_error(http.post("/v1/completions", json={"prompt": "hi"}), 503)
    finally:
        eng.shutdown()


def test_null_fields_mean_defaults(http: httpx.Client) -> None:
    nulls = {k: None for k in ("temperature", "top_p", "n", "stop", "seed", "logprobs", "stream", "tools", "user")}
    resp = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, **nulls})
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 1


# --- native routes --------------------------------------------------------------------------------------------
def test_generate_single_batch_ids(http: httpx.Client, engine: Engine) -> None:
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    single = http.post("/generate", json={"text": "hello world", "sampling_params": sp}).json()
    assert single["meta_info"]["completion_tokens"] == len(single["output_ids"]) == 6
    assert single["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert single["text"] == engine.generate("hello world", sp)["text"]  # same ids as the in-process API
    batch = http.post("/generate", json={"text": ["hello world", "abc"], "sampling_params": sp}).json()
    assert isinstance(batch, list) and batch[0]["text"] == single["text"]
    ids = engine.tokenizer.encode("hello world", add_special_tokens=False)
    by_ids = http.post("/generate", json={"input_ids": ids, "sampling_params": sp}).json()
    assert by_ids["output_ids"] == single["output_ids"]
    assert_error(http.post("/generate", json={"text": "x", "sampling_params": {"max_tokenz": 3}}), 400)
    assert_error(http.post("/generate", json={}), 400)


def test_generate_prompt_logprobs(http: httpx.Client) -> None:
    body = {
        "text": "The quick brown fox",
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    meta = http.post("/generate", json=body).json()["meta_info"]
    inputs = meta["input_token_logprobs"]
    assert len(inputs) == meta["prompt_tokens"] and inputs[0][0] is None
    assert all(lp <= 0 for lp, _, _ in inputs[1:]) and "".join(t for _, _, t in inputs) == body["text"]
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])


def test_generate_stream(http: httpx.Client) -> None:
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    plain = http.post("/generate", json=body).json()
    with http.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    assert events[-2]["text"] == plain["text"] and events[-2]["output_ids"] == plain["output_ids"]
    assert all(events[i]["text"].startswith(events[i - 1]["text"]) for i in range(1, len(events) - 1))


def test_server_info_flush_metrics(http: httpx.Client) -> None:
    info = http.get("/server_info").json()
    assert info["served_model_name"] == MODEL and info["server_config"]["api_key"] == ""
    assert {"total_tokens", "free_tokens", "in_use_tokens"} <= set(info["kv_cache"])
    assert http.post("/flush_cache").json()["success"] is True
    assert http.get("/server_info").json()["kv_cache"]["cached_tokens"] == 0
    http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    text = http.get("/metrics").text
    for name in (
        "radixserve:num_requests_running",
        "radixserve:kv_cache_usage_perc",
        "radixserve:prefix_cache_hit_rate",
        "radixserve:prompt_tokens_total",
        "radixserve:generation_tokens_total",
        "radixserve:time_to_first_token_seconds_bucket",
        "radixserve:e2e_request_latency_seconds_count",
        "radixserve:inter_token_latency_seconds_sum",
        'radixserve:request_success_total{finished_reason="length"',
    ):
        assert name.split("{")[0] in text, name

    def count(name: str) -> float:
        lines = [ln for ln in http.get("/metrics").text.splitlines() if ln.startswith(f"radixserve:{name}_count{{")]
        return float(lines[0].rsplit(" ", 1)[1])

    ttft, queued = count("time_to_first_token_seconds"), count("request_queue_time_seconds")
    http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 0}})  # a prefill: no token
    assert count("time_to_first_token_seconds") == ttft and count("request_queue_time_seconds") == queued + 1


def test_abort_request(http: httpx.Client, server: ServerThread) -> None:
    assert_error(http.post("/abort_request", json={"rid": "no-such-request"}), 404, param="rid")
    body = {
        "text": "hello",
        "rid": "abort-me",
        "stream": True,
        "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True},
    }
    with httpx.Client(base_url=server.url, timeout=60) as other, other.stream("POST", "/generate", json=body) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["meta_info"]["id"] == "abort-me"
        assert_error(http.post("/abort_request", json={"rid": "abort"}), 404, param="rid")  # not another's prefix
        assert http.post("/abort_request", json={"rid": "abort-me"}).json()["aborted"] == ["abort-me"]
        events = sse_events(lines)
    assert events[-1] == "[DONE]"
    assert events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert events[-2]["meta_info"]["completion_tokens"] < 1900
    wait_idle(http)


# --- client disconnects ---------------------------------------------------------------------------------------
def test_disconnect_mid_stream_frees_kv(http: httpx.Client, server: ServerThread) -> None:
    aborted = abort_count(http)
    body = {"messages": USER, "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=server.url, timeout=60) as raw,
        raw.stream("POST", "/v1/chat/completions", json=body) as resp,
    ):
        lines = resp.iter_lines()
        for _ in range(3):
            next(lines)
    # Leaving the block closed the connection mid-stream.
    info = wait_idle(http)
    assert info["kv_cache"]["in_use_tokens"] == 0
    assert abort_count(http) == aborted + 1


def test_disconnect_while_waiting_non_streaming(http: httpx.Client, server: ServerThread) -> None:
    aborted = abort_count(http)
    body = {"prompt": "hello", "max_tokens": 1900, "n": 2, "extra": 1, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
    wait_idle(http)
    assert abort_count(http) == aborted + 2
