"""Chat templates over the tiny model's server: ``--chat-template`` overrides the model's, the ready line names
the served model, and a template without a system role gets the system text in the first user turn."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from radixserve.runtime.engine import Engine
from radixserve.server import ServerConfig, create_app
from radixserve.server.testing import ServerThread
from tests.test_server_tiny import USER, assert_error


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    eng = Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=4096)
    yield eng
    eng.shutdown()


def test_chat_template_override_and_ready_line(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    config = ServerConfig(chat_template=template, served_model_name="custom")
    with caplog.at_level(logging.INFO, logger="radixserve.server"), ServerThread(create_app(engine, config)) as srv:
        sdk = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        resp = sdk.chat.completions.create(model="custom", messages=USER, max_tokens=1)
    expected = engine.tokenizer.encode(f"[user] {USER[0]['content']}\n[assistant] ", add_special_tokens=False)
    assert resp.usage.prompt_tokens == len(expected)
    assert f"radixserve ready: serving custom at http://127.0.0.1:{srv.port} (OpenAI API at /v1)" in caplog.text


# A template in the manner of Gemma 2's: turns of user and model only, a system message refused by the template.
NO_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}<turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end>\n"
    "{% endfor %}<turn>model\n"
)


def test_a_template_without_a_system_role_gets_the_system_text_in_the_first_user_turn(engine: Engine) -> None:
    config = ServerConfig(chat_template=NO_SYSTEM_TEMPLATE, served_model_name="gemma-like")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    with ServerThread(create_app(engine, config)) as srv:
        sdk = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        plain = sdk.chat.completions.create(model="gemma-like", messages=messages, max_tokens=1)
        with_tools = sdk.chat.completions.create(model="gemma-like", messages=messages, tools=tools, max_tokens=1)
        http = httpx.Client(base_url=srv.url)
        lone = http.post("/v1/chat/completions", json={"messages": messages[:1], "max_tokens": 1})
    text = f"<turn>user\nBe brief.\n\n{USER[0]['content']}<end>\n<turn>model"  # (Jinja drops a final newline)
    assert plain.usage.prompt_tokens == len(engine.tokenizer.encode(text, add_special_tokens=False))
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools' instructions joined them
    assert_error(lone, 400)  # nothing to fold into: the template's own refusal, as a 400
    assert "System role not supported" in lone.json()["error"]["message"]


def test_continue_final_message(engine: Engine) -> None:
    """vLLM's prefill: with ``continue_final_message`` (and ``add_generation_prompt`` false) the prompt ends inside
    the assistant's last message, and the answer is its continuation; misuse is a 400 naming the field."""
    prefill = [*USER, {"role": "assistant", "content": "The capital is"}]
    with ServerThread(create_app(engine, ServerConfig(served_model_name="tiny"))) as srv, httpx.Client(
        base_url=srv.url, timeout=60
    ) as http:
        body = {"model": "tiny", "messages": prefill, "max_tokens": 4, "temperature": 0}
        r = http.post("/v1/chat/completions", json=body | {"continue_final_message": True,
                                                          "add_generation_prompt": False})  # fmt: skip
        assert r.status_code == 200, r.text
        text = engine.tokenizer.apply_chat_template(prefill, tokenize=False, continue_final_message=True)
        assert text.endswith("The capital is")
        assert r.json()["usage"]["prompt_tokens"] == len(engine.tokenizer.encode(text, add_special_tokens=False))
        alone = engine.generate(text, {"max_new_tokens": 4, "temperature": 0})["text"]
        assert r.json()["choices"][0]["message"]["content"] == alone
        # Without it the prefill is a finished turn and a new one starts: a longer prompt.
        r = http.post("/v1/chat/completions", json=body)
        assert r.json()["usage"]["prompt_tokens"] > len(engine.tokenizer.encode(text, add_special_tokens=False))
        r = http.post("/v1/chat/completions", json=body | {"continue_final_message": True})
        assert_error(r, 400, param="add_generation_prompt", text="continue_final_message")
        r = http.post("/v1/chat/completions", json=body | {"messages": USER, "continue_final_message": True,
                                                          "add_generation_prompt": False})  # fmt: skip
        assert_error(r, 400, param="messages", text="assistant message")
