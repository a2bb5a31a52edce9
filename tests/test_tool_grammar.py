"""The ``tool_or_answer`` constraint with the real SmolLM2 tokenizer: either an answer in its schema or tool calls
in ``<tool_call>`` tags whose arguments follow the tool's schema; errors point into the part at fault."""

from __future__ import annotations

import pytest

from radixserve.constrained import ConstraintSpec, GrammarCompiler, GrammarError, TokenizerInfo
from radixserve.constrained.alt_backends import XGrammarBackend

CALL = {
    "anyOf": [
        {
            "type": "object",
            "properties": {
                "name": {"const": "get_weather"},
                "arguments": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {"name": {"const": "now"}, "arguments": {"type": "object", "additionalProperties": False}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
    ]
}
ANSWER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "celsius": {"type": "integer", "minimum": -90, "maximum": 60}},
    "required": ["city", "celsius"],
    "additionalProperties": False,
}
ONE_CALL = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
TWO_CALLS = ONE_CALL + '\n<tool_call>{"name":"now","arguments":{}}</tool_call>'


@pytest.fixture(scope="module")
def info() -> TokenizerInfo:
    from radixserve.runtime.model_source import resolve_model
    from radixserve.runtime.weights import load_tokenizer

    return TokenizerInfo.from_hf(load_tokenizer(resolve_model("smollm2-135m-instruct")))


@pytest.fixture(scope="module")
def compiler(info: TokenizerInfo):
    c = GrammarCompiler(info, timeout_s=10.0)
    yield c
    c.close()


def follows(compiler: GrammarCompiler, info: TokenizerInfo, spec: ConstraintSpec, text: str) -> bool:
    """Whether ``text`` is a complete output of ``spec``."""
    matcher = compiler.compile(spec).new_matcher()
    return all(matcher.accept_token(t) for t in info.ll_tokenizer.tokenize_str(text)) and matcher.can_terminate()


@pytest.mark.parametrize(
    ("text", "single", "parallel"),
    [
        ('{"city":"Paris","celsius":21}', True, True),
        (ONE_CALL, True, True),
        (TWO_CALLS, False, True),
        ('{"city":"Paris"}', False, False),  # the answer's schema holds: celsius is required
        ('{"city":"Paris","celsius":99}', False, False),
        ('<tool_call>{"name":"get_weather","arguments":{"town":"Paris"}}</tool_call>', False, False),
        ('<tool_call>{"name":"delete_all","arguments":{}}</tool_call>', False, False),
        ('<tool_call>{"name":"now","arguments":{}}', False, False),  # the close tag is part of the call
        ('Sure! {"city":"Paris","celsius":21}', False, False),
    ],
)
def test_output_is_an_answer_or_tool_calls(compiler, info, text: str, single: bool, parallel: bool) -> None:
    for is_parallel, expected in ((False, single), (True, parallel)):
        spec = ConstraintSpec("tool_or_answer", {"call": CALL, "answer": ANSWER, "parallel": is_parallel})
        assert follows(compiler, info, spec, text) is expected, (is_parallel, text)


def test_any_object_answer_and_both_branches_open_at_the_start(compiler, info) -> None:
    spec = ConstraintSpec("tool_or_answer", {"call": CALL, "answer": None})
    assert follows(compiler, info, spec, '{"whatever":[1,2,{"x":null}]}')
    assert follows(compiler, info, spec, ONE_CALL)
    assert not follows(compiler, info, spec, "[1,2]")  # no answer schema means any JSON object
    matcher = compiler.compile(spec).new_matcher()
    assert matcher.forced_tokens() == []  # the model chooses: nothing is forced before its first token


def test_key_is_canonical_and_defaults_are_explicit() -> None:
    a = ConstraintSpec("tool_or_answer", {"call": CALL, "answer": ANSWER})
    b = ConstraintSpec("tool_or_answer", {"answer": dict(reversed(ANSWER.items())), "call": CALL, "parallel": False})
    assert a.key == b.key
    assert a.value["open"] == "<tool_call>" and a.value["close"] == "</tool_call>"
    with pytest.raises(GrammarError, match="tool_or_answer must be"):
        ConstraintSpec("tool_or_answer", {"answer": ANSWER})
    with pytest.raises(GrammarError, match="json_schema is not valid JSON"):
        ConstraintSpec("tool_or_answer", {"call": "{not json", "answer": None})


def test_errors_point_into_the_part_at_fault(compiler) -> None:
    bad_call = {"type": "object", "properties": {"arguments": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(GrammarError) as err:
        compiler.compile(ConstraintSpec("tool_or_answer", {"call": bad_call, "answer": ANSWER}))
    assert (err.value.kind, err.value.keyword) == ("unsupported", "uniqueItems")
    assert err.value.pointer == "/call/properties/arguments" and "at /call/properties/arguments" in str(err.value)
    with pytest.raises(GrammarError) as err:
        compiler.compile(ConstraintSpec("tool_or_answer", {"call": CALL, "answer": {"type": "strin"}}))
    assert err.value.pointer == "/answer/type"
    with pytest.raises(GrammarError, match="the schema is false"):
        compiler.compile(ConstraintSpec("tool_or_answer", {"call": CALL, "answer": False}))
    with pytest.raises(GrammarError, match="forces a stretch") as err:
        huge = {"type": "string", "pattern": "(b{600}){600}"}
        ConstraintSpec("tool_or_answer", {"call": CALL, "answer": huge}).validate()
    assert err.value.kind == "too_complex" and err.value.pointer == "/answer/pattern"
    # What llguidance refuses inside one part is blamed on that part, without the lines of the union's grammar.
    far = {"type": "number", "minimum": 1e300}
    with pytest.raises(GrammarError) as err:
        compiler.compile(ConstraintSpec("tool_or_answer", {"call": CALL, "answer": far}))
    assert err.value.pointer == "/answer" and "call_block" not in str(err.value)


def test_screening_leaves_a_unions_error_to_the_full_compile(compiler) -> None:
    """Under a queue the screening used to raise llguidance's error for the whole union, with the lines of its
    grammar; the full compile traces it to the part at fault, so the client's 400 does not depend on load."""
    spec = ConstraintSpec("tool_or_answer", {"call": CALL, "answer": {"type": "string", "pattern": "(?=a)b"}})
    passed, grammar = compiler.backend.screen(spec)
    assert not passed and grammar
    with pytest.raises(GrammarError) as err:
        compiler.backend.compile(spec, grammar=grammar)
    assert err.value.pointer == "/answer/pattern" and "call_block" not in str(err.value)


def test_measurement_backends_refuse_it_clearly(info) -> None:
    pytest.importorskip("xgrammar")
    with pytest.raises(GrammarError, match="use llguidance") as err:
        XGrammarBackend(info).compile(ConstraintSpec("tool_or_answer", {"call": CALL, "answer": None}))
    assert err.value.kind == "unsupported"
