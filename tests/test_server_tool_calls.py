"""Forced tool calls without a model: the schema built from the tools, the streaming scanner, error mapping."""

from __future__ import annotations

import json

import jsonschema
import pytest

from radixserve.constrained import GrammarError
from radixserve.server.chat_core import check_options
from radixserve.server.constraints import RequestConstraint, at_most_one, make_constraint, response_format_constraint
from radixserve.server.errors import APIError
from radixserve.server.protocol import ChatCompletionRequest, ResponseFormat
from radixserve.server.tool_calls import ToolCallScanner, forced_tool_constraint, tool_or_answer_constraint

USER = [{"role": "user", "content": "hi"}]
ADD = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
    {"type": "function", "function": {"name": "now"}},
]


JSON_OBJECT = ResponseFormat(type="json_object")


def _request(**kw: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, "tools": TOOLS, **kw})


def test_forced_schema_accepts_exactly_the_calls() -> None:
    required = forced_tool_constraint(_request(tool_choice="required"))
    assert required is not None and required.param == "tools"
    schema = required.spec.value
    jsonschema.validate({"name": "add", "arguments": {"a": 1}}, schema)
    jsonschema.validate({"name": "now", "arguments": {}}, schema)
    for bad in ({"name": "add", "arguments": {}}, {"name": "now", "arguments": {"x": 1}}, {"name": "sub"}, []):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    named = forced_tool_constraint(_request(tool_choice={"type": "function", "function": {"name": "now"}}))
    assert named is not None and named.spec.value["properties"]["name"] == {"const": "now"}
    parallel = forced_tool_constraint(_request(tool_choice="required", parallel_tool_calls=True))
    assert parallel is not None and parallel.spec.value["type"] == "array"
    jsonschema.validate([{"name": "now", "arguments": {}}, {"name": "add", "arguments": {"a": 2}}], parallel.spec.value)
    for choice in (None, "auto", "none"):
        assert forced_tool_constraint(_request(tool_choice=choice)) is None


def test_schema_errors_point_into_the_tool() -> None:
    parallel = forced_tool_constraint(_request(tool_choice="required", parallel_tool_calls=True))
    assert parallel is not None
    exc = GrammarError.unsupported("contains", "/items/anyOf/1/properties/arguments/properties/x", "why")
    err = parallel.error(exc)
    assert err.param == "tools[1].function.parameters" and "at /properties/x:" in err.message
    assert err.code == "unsupported_constraint" and err.status == 400
    other = parallel.error(GrammarError("compile timeout after 10 s", kind="timeout"))
    assert (other.param, other.code) == ("tools", "constraint_timeout")
    internal = parallel.error(GrammarError("boom", kind="internal"))
    assert internal.status == 500


def test_auto_with_a_response_format_allows_calls_or_the_answer() -> None:
    answer = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    fmt = response_format_constraint(ResponseFormat(type="json_schema", json_schema={"name": "a", "schema": answer}))
    union = tool_or_answer_constraint(_request(), fmt)
    assert union is not None and union.spec.kind == "tool_or_answer" and union.param == "tools"
    value = union.spec.value
    assert value["answer"] == answer and value["parallel"] is False
    jsonschema.validate({"name": "add", "arguments": {"a": 1}}, value["call"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "add", "arguments": {}}, value["call"])
    objects = tool_or_answer_constraint(_request(parallel_tool_calls=True), response_format_constraint(JSON_OBJECT))
    assert objects is not None and objects.spec.value["answer"] is None and objects.spec.value["parallel"] is True
    # A decided tool_choice, no tools or no format: no union.
    for req, f in [
        (_request(tool_choice="none"), fmt),
        (_request(tool_choice="required"), fmt),
        (ChatCompletionRequest.model_validate({"messages": USER}), fmt),
        (_request(), None),
    ]:
        assert tool_or_answer_constraint(req, f) is None
    # Errors land on the tool or on response_format.
    err = union.error(GrammarError.unsupported("contains", "/call/anyOf/0/properties/arguments/properties/a", "w"))
    assert err.param == "tools[0].function.parameters" and "at /properties/a:" in err.message
    err = union.error(GrammarError.invalid_schema("/answer/properties/x", "bad"))
    assert err.param == "response_format" and "at /properties/x:" in err.message
    with pytest.raises(APIError) as info:
        tool_or_answer_constraint(
            ChatCompletionRequest.model_validate({"messages": USER, "tools": [TOOLS[1], TOOLS[1]]}), fmt
        )
    assert info.value.param == "tools[1].function.name"


def test_auto_with_vllm_json_fields_allows_calls_or_the_answer() -> None:
    """guided_json (and its kin) with tools under "auto" is the same union as response_format: it constrained the
    whole output to the answer, which took the tools away."""
    answer = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    for fields, param in [
        ({"guided_json": answer}, "guided_json"),
        ({"json_schema": answer}, "json_schema"),
        ({"structured_outputs": {"json": answer}}, "structured_outputs.json"),
    ]:
        constraint, forced = check_options(_request(**fields))
        assert constraint is not None and constraint.spec.kind == "tool_or_answer" and not forced
        assert constraint.spec.value["answer"] == answer
        err = constraint.error(GrammarError.invalid_schema("/answer/properties/x", "bad"))
        assert err.param == param and "at /properties/x:" in err.message
    constraint, _ = check_options(_request(guided_json=answer, tool_choice="none"))
    assert constraint is not None and constraint.spec.kind == "json_schema"
    constraint, _ = check_options(_request(guided_regex="a+"))
    assert constraint is not None and constraint.spec.kind == "regex"  # not JSON: no union, as before


def test_one_constraint_per_request() -> None:
    regex = make_constraint("regex", "a+", "regex")
    fmt = response_format_constraint(ResponseFormat(type="json_object"))
    assert at_most_one([None, regex]) is regex
    with pytest.raises(APIError) as info:
        at_most_one([regex, fmt])
    assert "'regex' and 'response_format'" in info.value.message and info.value.code == "conflicting_constraints"
    assert response_format_constraint(ResponseFormat(type="text")) is None
    with pytest.raises(APIError):
        response_format_constraint(ResponseFormat(type="json_schema", json_schema={"name": "x"}))
    with pytest.raises(APIError) as info:
        make_constraint("choice", [], "choices")
    assert info.value.param == "choices"


@pytest.mark.parametrize(
    "text",
    [
        '{"name":"add","arguments":{"a":1,"s":"}\\"{","l":[1,{"b":[]}]}}',
        '[{"name":"add","arguments":{"a":1}},{"name":"now","arguments":{}}]',
        '{"arguments":{"a":2},"name":"add"}',
        '{"name":"f","arguments":null}',
    ],
)
def test_scanner_streams_what_it_returns(text: str) -> None:
    whole = ToolCallScanner()
    whole.feed(text)
    streamed = ToolCallScanner()
    deltas = [d for ch in text for d in streamed.feed(ch)]
    assert whole.complete and streamed.complete
    calls = streamed.finish()
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.finish()]
    parsed = json.loads(text)
    for call, obj in zip(calls, parsed if isinstance(parsed, list) else [parsed]):
        assert call.name == obj["name"] and json.loads(call.arguments) == obj["arguments"]
    heads = [d for d in deltas if "id" in d]
    assert [h["function"]["name"] for h in heads] == [c.name for c in calls]
    for index, call in enumerate(calls):
        mine = [d for d in deltas if d["index"] == index]
        assert "id" in mine[0] and all("id" not in d for d in mine[1:])
        assert "".join(d["function"]["arguments"] for d in mine) == call.arguments


def test_scanner_on_a_cut_answer() -> None:
    scanner = ToolCallScanner()
    assert scanner.feed('{"name":"ad') == [] and scanner.finish() == []
    out = scanner.feed('d","arguments":{"a":1')
    assert out[0]["function"] == {"name": "add", "arguments": ""} and out[1]["function"] == {"arguments": '{"a":1'}
    assert not scanner.complete and scanner.finish()[0].arguments == '{"a":1'


def test_constraint_is_frozen_with_its_sub_params() -> None:
    c = RequestConstraint(make_constraint("regex", "x", "regex").spec, "regex")
    assert c.sub_params == () and c.error(GrammarError("bad")).param == "regex"


# How pydantic writes a model with a nested model (the OpenAI Agents SDK sends tools this way).
NESTED = {
    "$defs": {"Unit": {"enum": ["c", "f"], "type": "string"}},
    "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["city", "unit"],
    "type": "object",
    "additionalProperties": False,
}


def test_tool_parameters_with_local_refs_still_resolve_once_wrapped() -> None:
    """``#/$defs/Unit`` used to resolve against the wrapper's root: a 400 'points to a location that does not
    exist' for every pydantic tool with a nested model."""
    tools = [{"type": "function", "function": {"name": "weather", "parameters": NESTED}}, TOOLS[1]]
    good, bad = {"name": "weather", "arguments": {"city": "Oslo", "unit": "c"}}, {"city": "Oslo", "unit": "k"}
    fmt = response_format_constraint(JSON_OBJECT)
    req = ChatCompletionRequest.model_validate({"messages": USER, "tools": tools})
    union = tool_or_answer_constraint(req, fmt)
    assert union is not None
    for kw in ({"tool_choice": "required"}, {"tool_choice": "required", "parallel_tool_calls": True}):
        forced = forced_tool_constraint(ChatCompletionRequest.model_validate({"messages": USER, "tools": tools, **kw}))
        assert forced is not None
        schema, one = forced.spec.value, (lambda call: [call]) if kw.get("parallel_tool_calls") else (lambda c: c)
        jsonschema.validate(one(good), schema)  # an unresolvable $ref raises here
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(one({"name": "weather", "arguments": bad}), schema)
    jsonschema.validate(good, union.spec.value["call"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "weather", "arguments": bad}, union.spec.value["call"])
    assert NESTED["properties"]["unit"] == {"$ref": "#/$defs/Unit"}  # the request's own schema is not touched


def test_a_refused_pattern_in_tool_parameters_is_reported_at_that_tool() -> None:
    """Refused when the constraint is made (a forced stretch): it used to reach the client at ``tools`` with the
    wrapper's pointer."""
    huge = {"type": "object", "properties": {"x": {"type": "string", "pattern": "(a{1000}){1000}"}}}
    tools = [TOOLS[1], {"type": "function", "function": {"name": "spell", "parameters": huge}}]
    for body, fmt in (
        ({"tool_choice": "required"}, None),
        ({}, response_format_constraint(JSON_OBJECT)),
    ):
        req = ChatCompletionRequest.model_validate({"messages": USER, "tools": tools, **body})
        with pytest.raises(APIError) as info:
            forced_tool_constraint(req) if fmt is None else tool_or_answer_constraint(req, fmt)
        assert info.value.param == "tools[1].function.parameters", info.value.message
        assert "at /properties/x/pattern" in info.value.message


def test_arguments_are_always_an_object() -> None:
    """``parameters: {}`` (a tool that declares none) still forces an object; a schema of anything else is a 400
    at that tool (clients pass the arguments as keyword arguments)."""
    tools = [{"type": "function", "function": {"name": "ping", "parameters": {}}}]
    schema = forced_tool_constraint(_request(tools=tools, tool_choice="required")).spec.value  # type: ignore[union-attr]
    jsonschema.validate({"name": "ping", "arguments": {"any": 1}}, schema)
    for bad in (None, [], "x", 3):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"name": "ping", "arguments": bad}, schema)
    with pytest.raises(ValueError, match="JSON schema of an object"):
        _request(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}])
    _request(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": ["object", "null"]}}}])
