"""Real agent frameworks, installed from PyPI, against the HTTP server over the real default model.

LangChain's ``ChatOpenAI`` and the OpenAI Agents SDK (with its defaults, which speak the Responses API, and in
chat-completions mode through ``OpenAIChatCompletionsModel``) each run a tool-calling loop (the model calls a
tool, Python runs it, the result goes back, the model answers) and a
structured-output call, with nothing but ``base_url`` pointing them at us. The tool call is forced
(``tool_choice`` named or "required"), so the 135M model reliably makes it; its arguments are then grammar-bound
to the tool's schema, and the frameworks' own parsers must accept everything the server sends.

Greedy decoding on a module-scoped server with one request at a time, so the answers are deterministic.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Literal

import openai
import pytest
from agents import (
    Agent,
    ItemHelpers,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    RunResult,
    ToolCallItem,
    ToolCallOutputItem,
    function_tool,
    set_default_openai_client,
    set_tracing_disabled,
)
from agents.models import _openai_shared
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import BaseTool, tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from radixserve.runtime.engine import Engine
from radixserve.server import ServerConfig, create_app
from radixserve.server.testing import ServerThread

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m-instruct"
WEATHER_REPORT = {"conditions": "sunny", "celsius": 21}
MAX_TURNS = 4


class CityFacts(BaseModel):
    """Facts about a city. Every field is bounded, so a weak model cannot ramble past max_tokens."""

    name: str = Field(min_length=1, max_length=30)
    country: str = Field(min_length=1, max_length=30)
    continent: Literal["Africa", "Asia", "Europe", "North America", "South America", "Oceania"]
    is_capital: bool


class WeatherAnswer(BaseModel):
    city: str = Field(min_length=1, max_length=30)
    conditions: Literal["sunny", "cloudy", "rainy", "snowy"]
    celsius: int = Field(ge=-50, le=60)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    engine = Engine(model=MODEL, device="cpu", max_total_tokens=16384)
    try:
        with ServerThread(create_app(engine, ServerConfig(served_model_name=MODEL))) as srv:
            yield srv
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def llm(server: ServerThread) -> ChatOpenAI:
    return ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="x", temperature=0, max_tokens=128, max_retries=0, timeout=120
    )


# --------------------------------------------------------------------------------------------- LangChain
def _weather_tools(calls: list[dict[str, str]]) -> list[BaseTool]:
    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append({"tool": "get_weather", "city": city})
        return json.dumps({"city": city, **WEATHER_REPORT})

    @tool
    def get_time(city: str) -> str:
        """Get the local time in a city."""
        calls.append({"tool": "get_time", "city": city})
        return json.dumps({"city": city, "time": "10:30"})

    return [get_weather, get_time]


def test_langchain_structured_output(llm: ChatOpenAI) -> None:
    structured = llm.with_structured_output(CityFacts, method="json_schema", include_raw=True)
    out = structured.invoke("Describe the city of Paris as JSON.")
    assert out["parsing_error"] is None
    raw: AIMessage = out["raw"]
    assert raw.response_metadata["finish_reason"] == "stop"
    facts = out["parsed"]
    assert isinstance(facts, CityFacts)
    assert facts == CityFacts.model_validate_json(raw.content)  # the content is exactly the validated JSON
    assert "paris" in facts.name.lower()


def _run_tool_loop(llm: ChatOpenAI, tool_choice: str, stream: bool) -> tuple[list[BaseMessage], list[dict[str, str]]]:
    """The agent loop: the first turn must call a tool, later turns may (tool_choice "auto"); every call is run
    in Python and answered with a ToolMessage, until the model answers in prose."""
    calls: list[dict[str, str]] = []
    tools = {t.name: t for t in _weather_tools(calls)}
    messages: list[BaseMessage] = [HumanMessage("What is the weather like in Paris right now?")]
    for turn in range(MAX_TURNS):
        # strict: the tools' schemas get additionalProperties false, so the arguments hold exactly the parameters.
        model = llm.bind_tools(list(tools.values()), tool_choice=tool_choice if turn == 0 else "auto", strict=True)
        if stream:
            chunks = list(model.stream(messages))
            assert len(chunks) > 2  # really streamed
            merged = chunks[0]
            for chunk in chunks[1:]:
                merged += chunk
            assert isinstance(merged, AIMessageChunk)
            reply = AIMessage(
                content=merged.content,
                tool_calls=merged.tool_calls,
                invalid_tool_calls=merged.invalid_tool_calls,
                response_metadata=merged.response_metadata,
            )
        else:
            reply = model.invoke(messages)
        assert isinstance(reply, AIMessage) and not reply.invalid_tool_calls
        messages.append(reply)
        if not reply.tool_calls:
            return messages, calls
        assert reply.response_metadata["finish_reason"] == "tool_calls"
        for call in reply.tool_calls:
            selected = tools[call["name"]]
            assert selected.args_schema is not None
            selected.args_schema.model_validate(call["args"])  # the arguments fit the tool's signature
            result = selected.invoke(call)  # a ToolMessage answering this call's id
            assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
            messages.append(result)
    raise AssertionError(f"no final answer after {MAX_TURNS} turns: {messages}")


@pytest.mark.parametrize(
    ("tool_choice", "stream"), [("get_weather", False), ("required", True)], ids=["named", "required-streamed"]
)
def test_langchain_tool_calling_loop(llm: ChatOpenAI, tool_choice: str, stream: bool) -> None:
    messages, calls = _run_tool_loop(llm, tool_choice, stream)
    first = messages[1]
    assert isinstance(first, AIMessage) and first.tool_calls and not first.content
    assert first.tool_calls[0]["id"].startswith("call_")
    if tool_choice == "get_weather":
        assert first.tool_calls[0]["name"] == "get_weather"
    assert calls and "paris" in calls[0]["city"].lower()
    assert any(isinstance(m, ToolMessage) for m in messages)
    final = messages[-1]
    assert isinstance(final, AIMessage) and not final.tool_calls
    assert isinstance(final.content, str) and final.content.strip()
    assert final.response_metadata["finish_reason"] in ("stop", "length")


# ------------------------------------------------------------------------------------- OpenAI Agents SDK
@pytest.fixture
def default_client(server: ServerThread) -> Iterator[None]:
    """Our server as the SDK's default client: an agent naming its model by string then takes the SDK's default
    path, the Responses API (no ``set_default_openai_api``). One client per test: each test runs its own event
    loop, and a pooled connection must not outlive the loop it was opened in."""
    previous = _openai_shared.get_default_openai_client()
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    set_default_openai_client(client, use_for_tracing=False)
    yield
    _openai_shared.set_default_openai_client(previous)


def _agent(
    server: ServerThread, calls: list[str] | None, output_type: type[BaseModel] | None, api: str = "chat"
) -> Agent:
    """An agent over our server (``api`` "chat": chat completions; "responses": the SDK's defaults, which need the
    ``default_client`` fixture); with ``calls``, it has a get_weather tool that records them."""

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: The city name.
        """
        assert calls is not None
        calls.append(city)
        return json.dumps({"city": city, **WEATHER_REPORT})

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    # Forced on the first turn only: the SDK resets tool_choice after a tool call (reset_tool_choice).
    settings = ModelSettings(tool_choice="get_weather" if calls is not None else None, temperature=0, max_tokens=100)
    return Agent(
        name="weather",
        instructions="Answer weather questions with the get_weather tool.",
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client) if api == "chat" else MODEL,
        tools=[get_weather] if calls is not None else [],
        model_settings=settings,
        output_type=output_type,
    )


@pytest.fixture(scope="module", autouse=True)
def _no_tracing_upload() -> None:
    set_tracing_disabled(True)  # the SDK would otherwise try to upload traces to OpenAI


def _check_agent_run(result: RunResult, calls: list[str]) -> None:
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds[:2] == [ToolCallItem.__name__, ToolCallOutputItem.__name__], kinds
    assert len(calls) >= 1 and "paris" in calls[0].lower()


def test_agents_sdk_tool_calling_loop(server: ServerThread) -> None:
    calls: list[str] = []
    result = asyncio.run(Runner.run(_agent(server, calls, None), "What is the weather in Paris?", max_turns=MAX_TURNS))
    _check_agent_run(result, calls)
    assert isinstance(result.final_output, str) and result.final_output.strip()


def test_agents_sdk_structured_output(server: ServerThread) -> None:
    agent = _agent(server, None, WeatherAnswer)
    result = asyncio.run(Runner.run(agent, "It is sunny and 21 degrees in Paris. Report it.", max_turns=MAX_TURNS))
    answer = result.final_output
    assert isinstance(answer, WeatherAnswer)
    assert "paris" in answer.city.lower() and answer.conditions == "sunny"


def test_agents_sdk_tool_loop_with_output_type(server: ServerThread) -> None:
    """The usual agent: tools plus a typed final output. The SDK sends both on every turn."""
    calls: list[str] = []
    result = asyncio.run(
        Runner.run(_agent(server, calls, WeatherAnswer), "What is the weather in Paris?", max_turns=MAX_TURNS)
    )
    _check_agent_run(result, calls)
    answer = result.final_output
    assert isinstance(answer, WeatherAnswer)
    assert (answer.conditions, answer.celsius) == (WEATHER_REPORT["conditions"], WEATHER_REPORT["celsius"])


# ------------------------------------------------------------------- OpenAI Agents SDK, Responses API defaults
async def _run_streamed(agent: Agent, question: str) -> RunResult:
    result = Runner.run_streamed(agent, question, max_turns=MAX_TURNS)
    kinds = [event.type async for event in result.stream_events()]
    assert "raw_response_event" in kinds  # really streamed: the SDK saw the Responses events
    return result  # type: ignore[return-value]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_agents_sdk_defaults_tool_calling_loop(server: ServerThread, default_client: None, stream: bool) -> None:
    calls: list[str] = []
    agent = _agent(server, calls, None, api="responses")
    question = "What is the weather in Paris?"
    result = asyncio.run(_run_streamed(agent, question) if stream else Runner.run(agent, question, max_turns=MAX_TURNS))
    _check_agent_run(result, calls)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert result.final_output == ItemHelpers.text_message_outputs(result.new_items)
    assert all(r.usage.input_tokens > 0 for r in result.raw_responses)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_agents_sdk_defaults_output_type(server: ServerThread, default_client: None, stream: bool) -> None:
    agent = _agent(server, None, WeatherAnswer, api="responses")
    question = "It is sunny and 21 degrees in Paris. Report it."
    result = asyncio.run(_run_streamed(agent, question) if stream else Runner.run(agent, question, max_turns=MAX_TURNS))
    answer = result.final_output
    assert isinstance(answer, WeatherAnswer)
    assert "paris" in answer.city.lower() and answer.conditions == "sunny"


def test_agents_sdk_defaults_tool_loop_with_output_type(server: ServerThread, default_client: None) -> None:
    calls: list[str] = []
    agent = _agent(server, calls, WeatherAnswer, api="responses")
    result = asyncio.run(_run_streamed(agent, "What is the weather in Paris?"))
    _check_agent_run(result, calls)
    answer = result.final_output
    assert isinstance(answer, WeatherAnswer)
    assert (answer.conditions, answer.celsius) == (WEATHER_REPORT["conditions"], WEATHER_REPORT["celsius"])
