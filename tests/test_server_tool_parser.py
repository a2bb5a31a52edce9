"""Tool-call parsing of model answers, whole and streamed (server.tool_parser)."""

from __future__ import annotations

import json

import pytest

from radixserve.server.tool_parser import ToolCallStream, parse_tool_calls

NAMES = {"get_weather", "add"}


def args(call) -> dict:
    return json.loads(call.arguments)


def test_hermes_blocks_with_content() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    )
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "add"]
    assert args(calls[0]) == {"city": "Paris"} and args(calls[1]) == {"a": 1, "b": 2}
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    assert calls[0].to_openai(0) == {
        "index": 0,
        "id": calls[0].id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": calls[0].arguments},
    }


def test_only_calls_gives_no_content_and_unterminated_block_counts() -> None:
    content, calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1}}', NAMES)
    assert content is None and [c.name for c in calls] == ["add"]


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
        '  {"name": "get_weather", "parameters": {"city": "Oslo"}}\n',
        '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}',
        '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
    ],
)
def test_bare_json_forms(text: str) -> None:
    content, calls = parse_tool_calls(text, NAMES)
    assert content is None and len(calls) == 1
    assert calls[0].name == "get_weather" and args(calls[0]) == {"city": "Oslo"}


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is sunny.",
        '{"name": "unknown_tool", "arguments": {}}',  # not an offered tool
        '{"answer": 42}',  # JSON, but not a call
        '<tool_call>{"name": "add", "arguments": {"a": </tool_call>',  # malformed JSON
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        "Call get_weather with city Paris",
        # Not JSON that clients parse: once re-serialized as arguments '{"a": NaN}' / '{"a": Infinity}'.
        '<tool_call>{"name": "add", "arguments": {"a": NaN}}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {"a": 1e999}}</tool_call>',
        '{"name": "add", "arguments": "{\\"a\\": -Infinity}"}',
    ],
)
def test_not_a_call_stays_content(text: str) -> None:
    assert parse_tool_calls(text, NAMES) == (text, [])


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ('[get_weather(city="Paris")]', [("get_weather", {"city": "Paris"})]),
        (
            " [get_weather(city='Oslo', days=3, metric=True, unit=None), add(a=1.5, b=-2)]\n",
            [("get_weather", {"city": "Oslo", "days": 3, "metric": True, "unit": None}), ("add", {"a": 1.5, "b": -2})],
        ),
        ("[add(a=[1, 2], b={'x': (3, 4)})]", [("add", {"a": [1, 2], "b": {"x": [3, 4]}})]),
        ("[add()]", [("add", {})]),
    ],
)
def test_pythonic_calls(text: str, want: list) -> None:
    """Llama 3.2's and Llama 4's pythonic form (vLLM's pythonic parser): a list of calls with literal arguments."""
    content, calls = parse_tool_calls(text, NAMES)
    assert content is None and [(c.name, args(c)) for c in calls] == want
    assert parse_tool_calls(text, NAMES, bare_json=False) == (text, [])  # (not under the union grammar)


@pytest.mark.parametrize(
    "text",
    [
        "[unknown(a=1)]",  # not an offered tool
        "[add(1, 2)]",  # positional arguments
        "[add(a=b)]",  # a name, not a literal: nothing is evaluated
        "[add(a=__import__('os').getcwd())]",
        "[add(a=float('nan'))]",
        "[add(a={1, 2})]",  # a set: not JSON
        "[add(**{'a': 1})]",
        "[get_weather(city='Paris'), 'and more']",
        "[]",
        "[get_weather(city='Paris')",  # unterminated
        "[1, 2, 3]",
    ],
)
def test_not_a_pythonic_call_stays_content(text: str) -> None:
    assert parse_tool_calls(text, NAMES) == (text, [])


def stream(pieces: list[str]) -> tuple[str, list, list[str]]:
    filt = ToolCallStream(NAMES)
    sent = [filt.feed(p) for p in pieces]
    rest, calls = filt.finish()
    return "".join(sent) + rest, calls, sent


def test_stream_plain_text_flows_and_matches_whole() -> None:
    text, calls, sent = stream(["Hello ", "there,", " how", " are you?"])
    assert text == "Hello there, how are you?" and calls == []
    assert sent == ["Hello", " there,", " how", " are you?"]  # streamed as it comes; trailing space held a step


def test_stream_holds_tool_call_and_partial_tags() -> None:
    pieces = ["Sure", ". <tool", '_call>{"name": "add", ', '"arguments": {"a": 1}}', "</tool_call>"]
    text, calls, sent = stream(pieces)
    assert [c.name for c in calls] == ["add"]
    assert text == parse_tool_calls("".join(pieces), NAMES)[0] == "Sure."
    assert all("<" not in s for s in sent)


def test_stream_bare_json_is_held_then_parsed_or_released() -> None:
    _, calls, sent = stream(['{"name": "get_weather", ', '"arguments": {"city": "Rome"}}'])
    assert sent == ["", ""] and [c.name for c in calls] == ["get_weather"]
    text, calls, _ = stream(['{"answer"', ": 42}"])
    assert text == '{"answer": 42}' and calls == []


@pytest.mark.parametrize(
    "pieces",
    [
        ['{"name": "get_weather", ', '"arguments": {"city": "Rome"}}'],  # bare JSON: once also streamed as content
        ['[{"name": "add", "arguments": {"a": 1}}', ', {"name": "add", "arguments": {"a": 2}}]'],
        ["  lead ", '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'],  # was "  lead" vs "lead"
        ["  ", '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', "\n"],
        ["Sure.\n", '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', " and done."],
    ],
)
def test_stream_content_equals_whole(pieces: list[str]) -> None:
    text, calls, _ = stream(pieces)
    whole, whole_calls = parse_tool_calls("".join(pieces), NAMES)
    assert text == (whole or "") and [c.arguments for c in calls] == [c.arguments for c in whole_calls]
    assert calls


def test_stream_holds_a_pythonic_list_then_parses_it() -> None:
    text, calls, sent = stream(["[get_wea", "ther(city=", "'Paris')]"])
    assert (
        sent == ["", "", ""]
        and text == ""
        and [(c.name, args(c)) for c in calls] == [("get_weather", {"city": "Paris"})]
    )


def test_stream_lookalike_tag_is_released() -> None:
    text, calls, _ = stream(["a <tool", "box> b"])
    assert text == "a <toolbox> b" and calls == []


def test_block_extent_is_its_json_so_arguments_may_hold_the_close_tag() -> None:
    text = '<tool_call>{"name": "add", "arguments": {"note": "a</tool_call>b", "a": 1}}</tool_call>'
    content, calls = parse_tool_calls(text, NAMES)
    assert content is None and [args(c) for c in calls] == [{"note": "a</tool_call>b", "a": 1}]
    streamed, calls, _ = stream([text[:30], text[30:]])
    assert streamed == "" and len(calls) == 1
    # JSON, then something other than the close tag: not a call.
    junk = '<tool_call>{"name": "add", "arguments": {}} trailing</tool_call>'
    assert parse_tool_calls(junk, NAMES) == (junk, [])


def test_under_the_union_grammar_a_bare_json_answer_is_never_a_call() -> None:
    """With tools and a response_format, a bare JSON object is the answer (validated against the answer's schema
    only): reading it as a call would hand the client arguments no tool schema checked."""
    answer = '{"name": "add", "arguments": {"a": "not an integer"}}'
    assert parse_tool_calls(answer, NAMES, bare_json=False) == (answer, [])
    filt = ToolCallStream(NAMES, bare_json=False)
    assert filt.feed('{"name": "add", ') == '{"name": "add",'  # the answer streams at once
    assert filt.feed('"arguments": {}}') == ' "arguments": {}}' and filt.finish() == ("", [])
    block = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    assert [c.name for c in parse_tool_calls(block, NAMES, bare_json=False)[1]] == ["add"]
