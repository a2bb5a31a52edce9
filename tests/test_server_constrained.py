"""Constrained decoding through the HTTP API over the real default model, with the official openai SDK.

Every output is checked against what was asked (``jsonschema`` for schemas, ``re.fullmatch`` for regexes), at
temperature 1.0 where sampling could wander; errors must come back as OpenAI-shaped 400s naming the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from radixserve.runtime.engine import Engine
from radixserve.server import ServerConfig, create_app
from radixserve.server.testing import ServerThread

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m-instruct"
ASK_PERSON = [{"role": "user", "content": "Describe a fictional person as JSON."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "b": {"type": "integer", "minimum": -(10**6), "maximum": 10**6},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "City weather.", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": ADD}},
]
PARAMETERS = {"get_weather": WEATHER, "add": ADD}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# A keyword the compiler refuses rather than drop (a grammar cannot enforce distinct items).
UNIQUE_ITEMS = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    engine = Engine(model=MODEL, device="cpu", max_total_tokens=16384)
    try:
        with ServerThread(create_app(engine, ServerConfig(served_model_name=MODEL))) as srv:
            yield srv
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_json_schema_strict_validates_at_temperature_one(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    resp = client.chat.completions.create(
        model=MODEL, messages=ASK_PERSON, response_format=fmt, temperature=1.0, n=3, seed=11, max_tokens=300
    )
    assert len(resp.choices) == 3
    for choice in resp.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    # Cut short by max_tokens, a constrained answer still says "length".
    cut = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, response_format=fmt, max_tokens=4)
    assert cut.choices[0].finish_reason == "length"


def test_json_object_regex_choices_and_grammar(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Give a JSON object with the name and the age of a cat."}]
    obj = client.chat.completions.create(
        model=MODEL, messages=ask, response_format={"type": "json_object"}, temperature=0, max_tokens=200
    )
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)

    date = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
    ask = [{"role": "user", "content": "When did the French revolution start? Answer with a date."}]
    resp = client.chat.completions.create(
        model=MODEL, messages=ask, temperature=1.0, seed=3, max_tokens=30, extra_body={"regex": date}
    )
    assert re.fullmatch(date, resp.choices[0].message.content)

    cities = ["Paris", "London", "Berlin"]
    comp = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=10, temperature=1.0, extra_body={"choices": cities}
    )
    assert comp.choices[0].text in cities

    ebnf = 'root ::= answer ", " word "."\nanswer ::= "yes" | "no"\nword ::= [a-z]{1,12}'
    ask = [{"role": "user", "content": "Is the sky blue? Answer yes or no, then one word why."}]
    resp = client.chat.completions.create(
        model=MODEL, messages=ask, temperature=1.0, seed=5, max_tokens=30, extra_body={"ebnf": ebnf}
    )
    assert re.fullmatch(r"(yes|no), [a-z]{1,12}\.", resp.choices[0].message.content)


def _check_call(name: str, arguments: str) -> None:
    assert name in PARAMETERS
    jsonschema.validate(json.loads(arguments), PARAMETERS[name])


def test_tool_choice_required_and_named(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, temperature=1.0, max_tokens=120)
    for seed, choice in enumerate(["required", {"type": "function", "function": {"name": "add"}}]):
        resp = client.chat.completions.create(**kw, tool_choice=choice, seed=seed)
        out = resp.choices[0]
        assert out.finish_reason == "tool_calls" and out.message.content is None
        assert len(out.message.tool_calls) == 1
        call = out.message.tool_calls[0]
        assert call.type == "function" and re.fullmatch("call_[0-9a-f]+", call.id)
        _check_call(call.function.name, call.function.arguments)
        if isinstance(choice, dict):
            assert call.function.name == "add"


def test_tool_call_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice="required",
        temperature=1.0,
        seed=7,
        max_tokens=120,
        stream=True,
    )
    deltas, reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content
            deltas.extend(choice.delta.tool_calls or [])
            reasons.append(choice.finish_reason)
    assert reasons[-1] == "tool_calls"
    head, rest = deltas[0], deltas[1:]
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name in PARAMETERS and head.function.arguments == ""
    assert rest and all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    _check_call(head.function.name, "".join(d.function.arguments for d in rest))


REPORT = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "summary": {"type": "string", "maxLength": 80}},
    "required": ["city", "summary"],
    "additionalProperties": False,
}


def test_tools_auto_with_a_response_format(client: openai.OpenAI) -> None:
    """An agent's turn: tools, tool_choice "auto" and a typed answer. Every output is either valid tool calls or
    an answer that validates, and the model does use both."""
    fmt = {"type": "json_schema", "json_schema": {"name": "report", "schema": REPORT, "strict": True}}
    kw = dict(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, response_format=fmt, max_tokens=150)
    kinds = []
    for seed in range(12):  # 48 distinct seeds (choice i of a request takes seed + i)
        resp = client.chat.completions.create(**kw, temperature=1.0, n=4, seed=seed * 4)
        for out in resp.choices:
            if out.message.tool_calls:
                assert out.finish_reason == "tool_calls" and out.message.content is None
                for call in out.message.tool_calls:
                    _check_call(call.function.name, call.function.arguments)
                kinds.append("call")
            else:
                assert out.finish_reason == "stop", out.message.content
                jsonschema.validate(json.loads(out.message.content), REPORT)
                kinds.append("answer")
    # Before the union, a response_format made calls impossible: every output was an answer. Sampled here, about
    # one in ten calls the tool (3 or 4 in 32 seeds, with both samplers this project has had), so 48 seeds
    # leave a ~0.5% chance, for a given machine's numbers, that none does.
    assert "call" in kinds and "answer" in kinds, kinds


@pytest.mark.parametrize(
    ("extra", "param", "code", "text"),
    [
        ({"regex": "[0-9"}, "regex", "invalid_constraint", "regex"),
        ({"json_schema": {"type": 5}}, "json_schema", "invalid_constraint", "/type"),
        ({"response_format": UNIQUE_ITEMS}, "response_format", "unsupported_constraint", "'uniqueItems' at /"),
        ({"regex": "a+", "choices": ["a"]}, "choices", "conflicting_constraints", "'regex' and 'choices'"),
    ],
)
def test_constraint_errors(
    server: ServerThread, client: openai.OpenAI, extra: dict, param: str, code: str, text: str
) -> None:
    resp = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK_WEATHER, **extra}, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert (err["param"], err["code"]) == (param, code) and text in err["message"]
    body = {k: v for k, v in extra.items() if k != "response_format"}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=ASK_WEATHER,
            response_format=extra.get("response_format", openai.NOT_GIVEN),
            extra_body=body,
        )
    assert info.value.param == param and info.value.code == code
    # The server still serves.
    ok = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")
