"""Reasoning output (``--reasoning-parser``): the think section apart from the answer, in every chat-style API.

A tiny random model whose chat template opens a think section (as the DeepSeek-R1 distills' do) and whose
vocabulary has ``<think>`` / ``</think>`` as added tokens (as Qwen3's does). Its thinking is noise, so every
request caps it (``max_thinking_tokens``): the grammar closes the section at the cap, and a response schema then
binds the answer. Greedy decoding, so a streamed answer can be compared with the same request unstreamed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest

from radixserve.constrained import ConstraintSpec
from radixserve.runtime.engine import Engine
from radixserve.server import ServerConfig, create_app
from radixserve.server.reasoning import REASONING_PARSERS, ReasoningSplitter, split
from radixserve.server.testing import ServerThread
from tests.tiny_model import CHATML_TEMPLATE, make_tiny_model

MODEL = "tiny-thinker"
SAMPLED = {"temperature": 1.0, "seed": 5}
THINK_TEMPLATE = CHATML_TEMPLATE.replace(
    "{{ '<|im_start|>assistant\\n' }}", "{{ '<|im_start|>assistant\\n<think>\\n' }}"
)
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 8}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
CAP = 6
USER = [{"role": "user", "content": "What is the capital of France?"}]
FMT = REASONING_PARSERS["deepseek-r1"]


# ------------------------------------------------------------------------------------------------ splitter
@pytest.mark.parametrize(
    ("text", "opened", "expected"),
    [
        ("<think>\nplan  it </think>\n\nhello", False, ("plan  it", "hello")),
        ("plan</think>{}", True, ("plan", "{}")),
        ("  just an answer", False, (None, "just an answer")),
        ("<thi", False, (None, "<thi")),  # a tag that never completed is text
        ("still thinking </thi", True, ("still thinking </thi", "")),
        ("a </ b</think> c", True, ("a </ b", "c")),
    ],
)
def test_splitter_gives_the_same_parts_however_the_text_is_cut(
    text: str, opened: bool, expected: tuple[str | None, str]
) -> None:
    assert split(FMT, opened, text) == expected
    rng = random.Random(0)
    for _ in range(100):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text))))
        splitter = ReasoningSplitter(FMT, opened)
        parts = [p for a, b in zip([0, *cuts], [*cuts, len(text)]) for p in splitter.feed(text[a:b])]
        parts += splitter.finish()
        assert splitter.reasoning == expected[0]
        assert "".join(t for kind, t in parts if kind == "content") == expected[1]
        if expected[0] is not None:
            assert "".join(t for kind, t in parts if kind == "reasoning") == expected[0]


def test_opened_in_prompt() -> None:
    assert FMT.opened_in("<|im_start|>assistant\n<think>\n")
    assert not FMT.opened_in("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3 with thinking off
    assert not FMT.opened_in("<|im_start|>assistant\n")
    # The prompt's other text never decides: a question or system prompt may mention the tag.
    assert not FMT.opened_in("<|im_start|>user\nWhat does the <think> tag do?<|im_end|>\n<|im_start|>assistant\n")
    # A prefill being continued decides by its own text.
    assert FMT.opened_in("...<think>\nFirst,", prefill="<think>\nFirst,")
    assert not FMT.opened_in("...</think>\nThe", prefill="<think>a</think>\nThe")


def test_reasoning_spec_keys_and_validation() -> None:
    inner = ConstraintSpec("json_schema", SCHEMA)
    a = ConstraintSpec("reasoning", {"inner": inner, "opened": True, "max_tokens": 4})
    b = ConstraintSpec(
        "reasoning", {"inner": ConstraintSpec("json_schema", json.dumps(SCHEMA)), "opened": True, "max_tokens": 4}
    )
    assert a.key == b.key and a.key != ConstraintSpec("reasoning", {"inner": inner, "opened": True}).key
    with pytest.raises(ValueError, match="max_tokens"):
        ConstraintSpec("reasoning", {"inner": inner, "max_tokens": 0})
    with pytest.raises(ValueError, match="another kind"):
        ConstraintSpec("reasoning", {"inner": a})


def test_a_close_tag_of_several_tokens_closes_the_section(tmp_path: Path) -> None:
    """A vocabulary without a ``</think>`` token: the model's own close tag was refused at its last token (a
    ``stop`` lexeme hides its text), so an answer with a schema never came. The section ends at the first tag."""
    from transformers import AutoTokenizer

    from radixserve.constrained.backend import LLGuidanceBackend
    from radixserve.constrained.tokenizer import TokenizerInfo

    info = TokenizerInfo.from_hf(AutoTokenizer.from_pretrained(make_tiny_model(tmp_path)))
    assert len(info.ll_tokenizer.tokenize_str("</think>")) > 1
    backend = LLGuidanceBackend(info)

    def accepts(text: str, opened: bool, cap: int | None = None) -> bool:
        inner = ConstraintSpec("json_schema", {"type": "object"})
        value = {"inner": inner, "open": "<think>", "close": "</think>", "opened": opened, "max_tokens": cap}
        matcher = backend.compile(ConstraintSpec("reasoning", value)).new_matcher()
        return all(matcher.accept_token(t) for t in info.ll_tokenizer.tokenize_str(text)) and matcher.can_terminate()

    for opened in (True, False):
        head = "" if opened else "<think>"
        assert accepts(f"{head} a b </think>\n{{\"a\":1}}", opened)
        assert not accepts(f"{head} a </think> b </think>{{}}", opened)  # the first tag ends the section
        assert not accepts(f"{head} a b </think> not json", opened)
    assert accepts('{"a":1}', False)  # no section at all
    # With a cap the section ends there: the tag is forced after the cap's tokens.
    cap = len(info.ll_tokenizer.tokenize_str(" one two three"))
    assert accepts(" one two three</think>{}", True, cap=cap)
    assert not accepts(" one two three four</think>{}", True, cap=cap)


# ------------------------------------------------------------------------------------------------ server
@pytest.fixture(scope="module")
def thinker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("thinker"), added_tokens=("<think>", "</think>"), chat_template=THINK_TEMPLATE, seed=3
    )


@pytest.fixture(scope="module")
def engine(thinker_dir: Path) -> Iterator[Engine]:
    eng = Engine(model=str(thinker_dir), device="cpu", max_total_tokens=4096)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[ServerThread]:
    config = ServerConfig(served_model_name=MODEL, reasoning_parser="deepseek-r1")
    with ServerThread(create_app(engine, config)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, **extra: object) -> dict:
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    body = {"max_thinking_tokens": CAP, **extra}
    return dict(model=MODEL, messages=USER, response_format=fmt, max_tokens=80, extra_body=body, **SAMPLED)


def test_schema_applies_after_the_think_section(client: openai.OpenAI, server: ServerThread) -> None:
    resp = client.chat.completions.create(**_chat(client))
    message = resp.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert isinstance(reasoning, str) and reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    jsonschema.validate(json.loads(message.content), SCHEMA)  # the content is exactly the schema's JSON
    assert resp.choices[0].finish_reason == "stop"
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": reasoning}, timeout=30).json()["tokens"]
    thought = len(tokens)
    assert thought <= CAP + 1  # the cap closed the section (a token may hold text on both sides of a cut)


def test_streaming_splits_the_same(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(**_chat(client)).choices[0].message
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**_chat(client), stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
    assert reasoning == plain.model_extra["reasoning_content"] and content == plain.content


def test_responses_reasoning_item(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "a", "schema": SCHEMA}
    kwargs = dict(model=MODEL, input="Capital of France?", text={"format": fmt}, temperature=1.0, max_output_tokens=80)
    extra = {"max_thinking_tokens": CAP, "seed": 5}
    resp = client.responses.create(**kwargs, extra_body=extra)
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    jsonschema.validate(json.loads(resp.output_text), SCHEMA)
    assert 0 < resp.usage.output_tokens_details.reasoning_tokens <= CAP + 1
    with client.responses.stream(**kwargs, extra_body=extra) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    added, done = (
        next(e.item for e in events if e.type == kind)
        for kind in ("response.output_item.added", "response.output_item.done")
    )
    assert (added.type, added.status, done.type, done.status) == ("reasoning", "in_progress", "reasoning", "completed")
    thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thinking == final.output[0].content[0].text == resp.output[0].content[0].text
    assert final.output_text == resp.output_text


def test_messages_thinking_block(server: ServerThread) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    kwargs = dict(
        model=MODEL,
        max_tokens=80,
        messages=USER,
        thinking={"type": "enabled", "budget_tokens": CAP},
        extra_body={**SAMPLED, "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
    )
    msg = client.messages.create(**kwargs)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    jsonschema.validate(json.loads(msg.content[1].text), SCHEMA)
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == msg.content[0].thinking and final.content[1].text == msg.content[1].text


def test_thinking_cap_needs_a_reasoning_parser(engine: Engine) -> None:
    with ServerThread(create_app(engine, ServerConfig(served_model_name=MODEL))) as plain:
        client = openai.OpenAI(base_url=plain.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model=MODEL, messages=USER, max_tokens=4, extra_body={"max_thinking_tokens": 4}
            )
        assert err.value.body["param"] == "max_thinking_tokens"
        # Without the parser the think section is just content.
        resp = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, temperature=0)
        assert "reasoning_content" not in (resp.choices[0].message.model_extra or {})


def test_a_think_cap_holds_when_the_model_opens_the_section_itself(engine: Engine) -> None:
    """Not opened by the prompt, no answer constraint: the free answer also matched a section the model opened
    itself, so the cap never forced the close tag. An answer without a section is any other text. (The tags are
    single tokens, as in the reasoning models' vocabularies.)"""
    from radixserve.constrained.backend import LLGuidanceBackend
    from radixserve.constrained.tokenizer import TokenizerInfo

    info = TokenizerInfo.from_hf(engine.tokenizer)
    backend = LLGuidanceBackend(info)

    def accepts(cap: int | None, text: str) -> bool:
        value = {"inner": None, "open": "<think>", "close": "</think>", "opened": False, "max_tokens": cap}
        matcher = backend.compile(ConstraintSpec("reasoning", value)).new_matcher()
        return all(matcher.accept_token(t) for t in info.ll_tokenizer.tokenize_str(text)) and matcher.can_terminate()

    long = "<think> one two three four five six seven</think>Done."
    assert accepts(None, long) and not accepts(3, long)
    assert accepts(3, "<think> a</think>Done.")
    for answer in ("Done.", "  plain answer <think> in the middle", "<thinking about it>", "<", ""):
        assert accepts(3, answer), answer
