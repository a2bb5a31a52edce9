"""Anthropic's Messages API (``/v1/messages``) over the real default model, through the official ``anthropic`` SDK.

Greedy decoding (``temperature`` 0, which newer SDKs send through ``extra_body``) on a module-scoped server, one
request at a time, so a streamed message can be compared with the same request unstreamed.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import anthropic
import httpx
import pytest

from radixserve.runtime.engine import Engine
from radixserve.server import ServerConfig, create_app
from radixserve.server.testing import ServerThread

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m-instruct"
GREEDY = {"temperature": 0}
SYSTEM = "Answer in one sentence."
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine(model=MODEL, device="cpu", max_total_tokens=16384)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[ServerThread]:
    with ServerThread(create_app(engine, ServerConfig(served_model_name=MODEL))) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120)


def test_create(client: anthropic.Anthropic) -> None:
    msg = client.messages.create(model=MODEL, max_tokens=24, system=SYSTEM, messages=QUESTION, extra_body=GREEDY)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_") and msg.model == MODEL
    [block] = msg.content
    assert block.type == "text" and "Paris" in block.text
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert 0 < msg.usage.output_tokens <= 24
    total_input = msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    count = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=QUESTION)
    assert count.input_tokens == total_input
    again = client.messages.create(model=MODEL, max_tokens=24, system=SYSTEM, messages=QUESTION, extra_body=GREEDY)
    assert again.usage.cache_read_input_tokens >= total_input - 1  # the prompt is cached (up to its last token)


def test_stream_matches_create(client: anthropic.Anthropic) -> None:
    kwargs = dict(model=MODEL, max_tokens=32, system=SYSTEM, messages=QUESTION, extra_body=GREEDY)
    plain = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    # message_start has the cache split already (the same prompt ran just before: all but its last token cached).
    start = events[0].message.usage
    assert start.cache_read_input_tokens > 0 and start.input_tokens + start.cache_read_input_tokens == (
        plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    )
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == final.content[0].text == plain.content[0].text
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens


def test_tool_use_round_trip(client: anthropic.Anthropic) -> None:
    question = {"role": "user", "content": "What is the weather like in Paris?"}
    first = client.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=[question],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    assert first.stop_reason == "tool_use"
    [use] = first.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    assert "paris" in use.input["city"].lower()
    result = {"type": "tool_result", "tool_use_id": use.id, "content": '{"conditions": "sunny", "celsius": 21}'}
    second = client.messages.create(
        model=MODEL,
        max_tokens=40,
        messages=[question, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}],
        tools=[WEATHER_TOOL],
        extra_body=GREEDY,
    )
    assert second.content[0].type == "text" and second.content[0].text.strip()
    assert second.stop_reason in ("end_turn", "max_tokens")


def test_streamed_tool_use(client: anthropic.Anthropic) -> None:
    kwargs = dict(
        model=MODEL,
        max_tokens=60,
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    )
    plain = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"]
    fragments = "".join(
        e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    [use] = final.content
    assert json.loads(fragments) == use.input == plain.content[0].input
    assert final.stop_reason == "tool_use"


def test_stop_sequences_and_output_config(client: anthropic.Anthropic) -> None:
    counting = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    msg = client.messages.create(model=MODEL, max_tokens=40, messages=counting, stop_sequences=["5"], extra_body=GREEDY)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "5"
    assert "5" not in msg.content[0].text and "4" in msg.content[0].text
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    msg = client.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=[{"role": "user", "content": "Name a city and its country."}],
        extra_body={**GREEDY, "output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )
    answer = json.loads(msg.content[0].text)
    assert set(answer) == {"city", "country"}


def test_assistant_prefill_is_continued(client: anthropic.Anthropic, engine: Engine) -> None:
    """A last assistant message is a prefill: the answer continues it (and holds the continuation only)."""
    prefill = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    msg = client.messages.create(model=MODEL, max_tokens=6, messages=prefill, extra_body=GREEDY)
    text = engine.tokenizer.apply_chat_template(prefill, tokenize=False, continue_final_message=True)
    assert text.endswith("The capital of France is")
    prompt = msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert prompt == len(engine.tokenizer.encode(text, add_special_tokens=False))
    assert msg.content[0].text == engine.generate(text, {"max_new_tokens": 6, "temperature": 0})["text"]
    assert "Paris" in msg.content[0].text
    empty = [*QUESTION, {"role": "assistant", "content": ""}]  # nothing to continue: an answer from the start
    assert client.messages.create(model=MODEL, max_tokens=1, messages=empty, extra_body=GREEDY).content


def test_an_aborted_message_is_a_paused_turn(server: ServerThread) -> None:
    """An answer cut by ``/abort_request`` must not read as finished: ``pause_turn``, not ``end_turn``."""
    body = {"model": MODEL, "max_tokens": 1500, "messages": [{"role": "user", "content": "Write a long story."}]}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        with http.stream("POST", "/v1/messages", json=body | {"stream": True}) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if '"text_delta"' in line)
            assert http.post("/abort_request", json={"abort_all": True}).status_code == 200
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        [delta] = [e for e in rest if e["type"] == "message_delta"]
        assert delta["delta"]["stop_reason"] == "pause_turn" and rest[-1]["type"] == "message_stop"
        threading.Timer(1.0, lambda: http.post("/abort_request", json={"abort_all": True})).start()
        r = http.post("/v1/messages", json=body)
        assert r.status_code == 200 and r.json()["stop_reason"] == "pause_turn", r.text


def test_errors_have_anthropic_shape(server: ServerThread, client: anthropic.Anthropic, engine: Engine) -> None:
    bad = [
        dict(max_tokens=8, messages=[]),
        dict(max_tokens=8, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
        dict(max_tokens=8, messages=QUESTION, tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        dict(max_tokens=8, messages=QUESTION, tool_choice={"type": "any"}),
        dict(max_tokens=10**7, messages=QUESTION),
        dict(max_tokens=8, messages=[{"role": "robot", "content": "hi"}]),
        dict(max_tokens=8, messages=[{"role": "user", "content": []}]),
        dict(max_tokens=8, messages=[{"role": "user", "content": [{"type": "text"}]}]),
        dict(max_tokens=8, messages=QUESTION, extra_body={"temperature": 5}),  # Anthropic's range is [0, 1]
        dict(max_tokens=8, messages=[*QUESTION, {"role": "assistant", "content": "The capital is "}]),
    ]
    for kwargs in bad:
        with pytest.raises(anthropic.BadRequestError) as err:
            client.messages.create(model=MODEL, **kwargs)
        body = err.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        assert body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="claude-nonexistent", max_tokens=8, messages=QUESTION)
    assert err.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, "messages": QUESTION}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"  # max_tokens is required
    assert "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/messages", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"

    # Anthropic's clients authenticate with x-api-key.
    with ServerThread(create_app(engine, ServerConfig(served_model_name=MODEL, api_key="sekrit"))) as keyed:
        good = anthropic.Anthropic(base_url=keyed.url, api_key="sekrit", max_retries=0)
        assert good.messages.create(model=MODEL, max_tokens=2, messages=QUESTION).content
        with pytest.raises(anthropic.AuthenticationError) as err:
            anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0).messages.create(
                model=MODEL, max_tokens=2, messages=QUESTION
            )
        assert err.value.body["error"]["type"] == "authentication_error"
