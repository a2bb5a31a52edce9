"""The HTTP server over the real default model (fetched and cached on first use), through the openai SDK."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from radixserve.runtime.config import DEFAULT_MODEL
from radixserve.runtime.engine import Engine
from radixserve.server import ServerConfig, create_app
from radixserve.server.testing import ServerThread

pytestmark = pytest.mark.real_model

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine(model=DEFAULT_MODEL, device="cpu", max_total_tokens=16384)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def client(engine: Engine) -> Iterator[openai.OpenAI]:
    with ServerThread(create_app(engine, ServerConfig())) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


def test_greedy_chat_is_deterministic(client: openai.OpenAI) -> None:
    kw = dict(model=DEFAULT_MODEL, messages=QUESTION, max_tokens=32, temperature=0)
    first = client.chat.completions.create(**kw)
    second = client.chat.completions.create(**kw)
    answer = first.choices[0].message.content
    assert answer and answer.strip()
    assert answer == second.choices[0].message.content


def test_stream_equals_plain(client: openai.OpenAI) -> None:
    kw = dict(model=DEFAULT_MODEL, messages=QUESTION, max_tokens=32, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    chunks = client.chat.completions.create(**kw, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain


def test_cached_tokens_on_repeated_long_prompt(client: openai.OpenAI) -> None:
    system = "You are a meticulous assistant. " + " ".join(f"Rule {i}: always be concise and exact." for i in range(40))
    messages = [{"role": "system", "content": system}, *QUESTION]
    kw = dict(model=DEFAULT_MODEL, messages=messages, max_tokens=4, temperature=0)
    client.chat.completions.create(**kw)
    again = client.chat.completions.create(**kw)
    assert again.usage.prompt_tokens > 300
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens // 2


def test_usage_is_consistent(client: openai.OpenAI, engine: Engine) -> None:
    resp = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=QUESTION, max_tokens=20, temperature=0, logprobs=True
    )
    usage = resp.usage
    rendered = engine.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert usage.prompt_tokens == len(engine.tokenizer.encode(rendered, add_special_tokens=False))
    assert usage.completion_tokens == len(resp.choices[0].logprobs.content) <= 20
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if resp.choices[0].finish_reason == "length":
        assert usage.completion_tokens == 20


def test_logprob_bytes_join_into_the_answer(client: openai.OpenAI) -> None:
    """Each token's ``bytes`` are its own, so the pieces of a character split over tokens (an emoji: each piece
    alone reads U+FFFD) join into the answer."""
    messages = [{"role": "user", "content": "Reply with exactly this and nothing else: 🎉🚀 héllo"}]
    resp = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=12, temperature=0,
                                          logprobs=True, stop=["\n"])  # fmt: skip
    content = resp.choices[0].logprobs.content
    assert any(e.token == "\ufffd" for e in content), [e.token for e in content]  # the answer splits a character
    assert bytes(b for e in content for b in e.bytes).decode("utf-8") == resp.choices[0].message.content


def test_tools_auto_round_trip(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    kw = dict(model=DEFAULT_MODEL, tools=[WEATHER_TOOL], max_tokens=64, temperature=0)
    resp = client.chat.completions.create(messages=messages, **kw)
    choice = resp.choices[0]
    if not choice.message.tool_calls:  # a 135M model may well answer in prose
        assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
        return
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert isinstance(json.loads(call.function.arguments), dict)
    messages += [
        {"role": "assistant", "content": choice.message.content, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": "Paris", "weather": "sunny"})},
    ]
    follow = client.chat.completions.create(messages=messages, **kw)
    assert follow.choices[0].message.content is not None or follow.choices[0].message.tool_calls
