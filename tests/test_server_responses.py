"""The Responses API (``/v1/responses``) over the real default model, through the official ``openai`` SDK.

Greedy decoding on a module-scoped server, one request at a time, so answers are deterministic and a streamed
response can be compared with the same request unstreamed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from radixserve.runtime.engine import Engine
from radixserve.server import ServerConfig, create_app
from radixserve.server.testing import ServerThread

pytestmark = pytest.mark.real_model

MODEL = "smollm2-135m-instruct"
QUESTION = "What is the capital of France?"
BRIEF = "Answer in one sentence."
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    continent: Literal["Africa", "Asia", "Europe", "North America", "South America", "Oceania"]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine(model=MODEL, device="cpu", max_total_tokens=16384)
    try:
        yield eng
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[ServerThread]:
    with ServerThread(create_app(engine, ServerConfig(served_model_name=MODEL))) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_create_retrieve_delete(client: openai.OpenAI) -> None:
    resp = client.responses.create(model=MODEL, input=QUESTION, instructions=BRIEF, max_output_tokens=24, temperature=0)
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.status in ("completed", "incomplete") and resp.model == MODEL
    [message] = resp.output
    assert message.type == "message" and message.role == "assistant"
    assert "Paris" in resp.output_text
    usage = resp.usage
    assert usage is not None and usage.input_tokens > 10 and 0 < usage.output_tokens <= 24
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    if resp.status == "incomplete":
        assert resp.incomplete_details is not None and resp.incomplete_details.reason == "max_output_tokens"

    stored = client.responses.retrieve(resp.id)
    assert stored.id == resp.id and stored.output_text == resp.output_text
    items = client.responses.input_items.list(resp.id)
    assert [i.type for i in items.data] == ["message"]
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(resp.id)
    assert err.value.body["type"] == "not_found_error"  # OpenAI's error shape


def test_store_false_is_not_kept(client: openai.OpenAI) -> None:
    resp = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, temperature=0, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


def test_stream_event_order_matches_create(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, input=QUESTION, instructions=BRIEF, max_output_tokens=40)
    plain = client.responses.create(**kwargs, temperature=0)
    with client.responses.stream(**kwargs, temperature=0) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    end = "response.completed" if plain.status == "completed" else "response.incomplete"
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done", end]
    assert kinds[-4:] == tail
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == plain.output_text
    assert final.output[0].id == events[2].item.id  # the item keeps its id from added to completed
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_forced_tool_call_round_trip(client: openai.OpenAI) -> None:
    """The model calls the tool; the client runs it and sends the output back; the model answers in prose."""
    question = {"role": "user", "content": "What is the weather like in Paris?"}
    first = client.responses.create(
        model=MODEL, input=[question], tools=[WEATHER_TOOL], tool_choice="required", temperature=0, max_output_tokens=60
    )
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert "paris" in json.loads(call.arguments)["city"].lower()
    assert first.status == "completed"
    output = {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": '{"conditions": "sunny", "celsius": 21}',
    }
    second = client.responses.create(
        model=MODEL,
        input=[question, call.model_dump(exclude_none=True), output],
        tools=[WEATHER_TOOL],
        temperature=0,
        max_output_tokens=40,
    )
    assert second.output[0].type == "message" and second.output_text.strip()
    # The same turn through previous_response_id: only the new item is sent, the rest comes from the store.
    third = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[output],
        tools=[WEATHER_TOOL],
        temperature=0,
        max_output_tokens=40,
    )
    # (Not compared with ``second``'s text: served from the cache, the prompt's tail is computed in another chunking,
    # and this 135M model's first answer token is a near tie.)
    assert third.output[0].type == "message" and third.output_text.strip()
    assert third.usage.input_tokens == second.usage.input_tokens  # the same prompt, rebuilt from the store
    assert third.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_streamed_tool_call_arguments(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, input="Weather in Rome?", tools=[WEATHER_TOOL], max_output_tokens=60)
    choice = {"type": "function", "name": "get_weather"}
    plain = client.responses.create(**kwargs, tool_choice=choice, temperature=0)
    with client.responses.stream(**kwargs, tool_choice=choice, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    fragments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [call] = final.output
    assert fragments == call.arguments == plain.output[0].arguments
    assert json.loads(call.arguments)["city"]


def test_structured_output_with_parse(client: openai.OpenAI) -> None:
    resp = client.responses.parse(
        model=MODEL, input="Describe the city of Paris.", text_format=City, temperature=0, max_output_tokens=80
    )
    assert isinstance(resp.output_parsed, City)
    assert City.model_validate_json(resp.output_text) == resp.output_parsed


def test_previous_response_id_three_turns_hit_the_cache(client: openai.OpenAI) -> None:
    turns = ["My name is Ada and I like tea.", "What do I like to drink?", "And what is my name?"]
    previous = None
    for i, text in enumerate(turns):
        resp = client.responses.create(
            model=MODEL,
            input=text,
            previous_response_id=previous.id if previous else None,
            instructions="Be brief.",
            max_output_tokens=24,
            temperature=0,
        )
        if previous is not None:
            # Every token of the earlier turn's prompt is served from the radix cache.
            assert resp.usage.input_tokens_details.cached_tokens >= previous.usage.input_tokens, i
            assert resp.usage.input_tokens > previous.usage.input_tokens + previous.usage.output_tokens
        previous = resp
    items = client.responses.input_items.list(previous.id).data
    assert [i.type for i in items][::-1][:2] == ["message", "message"] and len(items) == 5
    # Pages: ids, order, limit and after, as OpenAI lists them.
    oldest = client.responses.input_items.list(previous.id, order="asc", limit=2)
    assert [i.id for i in oldest.data] == [i.id for i in items][::-1][:2] and oldest.has_more
    assert oldest.first_id == oldest.data[0].id and oldest.last_id == oldest.data[1].id
    rest = client.responses.input_items.list(previous.id, order="asc", after=oldest.last_id)
    assert [i.id for i in rest.data] == [i.id for i in items][::-1][2:] and not rest.has_more
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(previous.id, limit=0)


def test_logprobs(client: openai.OpenAI) -> None:
    """``include: ["message.output_text.logprobs"]`` (and ``top_logprobs``) give the answer's token logprobs,
    the same streamed (on the text deltas and the done event) as not."""
    kwargs = dict(model=MODEL, input=QUESTION, max_output_tokens=6, temperature=0, top_logprobs=2,
                  include=["message.output_text.logprobs"])  # fmt: skip
    plain = client.responses.create(**kwargs)
    part = plain.output[0].content[0]
    assert len(part.logprobs) == plain.usage.output_tokens
    assert "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert streamed == [lp.token for lp in part.logprobs]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.token for lp in done.logprobs] == streamed
    bare = client.responses.create(**(kwargs | {"include": None, "top_logprobs": None}))
    assert bare.output[0].content[0].logprobs == []


def test_bad_input_is_a_400_in_openai_shape(server: ServerThread, client: openai.OpenAI) -> None:
    bad = [
        (dict(input=QUESTION, tools=[{"type": "web_search"}]), "tools[0].type"),
        (dict(input=QUESTION, previous_response_id="resp_missing"), "previous_response_id"),
        (dict(input=[{"type": "input_image", "image_url": "x"}]), "input[0].type"),
        (
            dict(input=QUESTION, text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}),
            "text.format",
        ),
        (dict(input=QUESTION, max_output_tokens=10**7), "max_output_tokens"),
        (dict(input=QUESTION, tool_choice="required"), "tool_choice"),
        (dict(input=QUESTION, tool_choice="bogus"), "tool_choice"),
        (dict(input=QUESTION, tools=[{"type": "function", "parameters": {}}]), "tools[0].name"),
        (dict(input=QUESTION, top_logprobs=21), "top_logprobs"),
        (dict(input=QUESTION, extra_body={"regex": "[0-9]+"}), "regex"),  # not read here: never a silent 200
    ]
    for kwargs, param in bad:
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=MODEL, **kwargs)
        assert err.value.status_code == 400
        assert err.value.body["param"] == param, (kwargs, err.value.body)
        assert err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input=QUESTION)
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = httpx.post(server.url + "/v1/responses", json={"input": QUESTION, "background": True, "store": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "store"


STORY = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def _settle(client: openai.OpenAI, rid: str, timeout: float = 60.0) -> openai.types.responses.Response:
    deadline = time.monotonic() + timeout
    while (resp := client.responses.retrieve(rid)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, resp.status
        time.sleep(0.1)
    return resp


def _idle(server: ServerThread, timeout: float = 10.0) -> None:
    """No request left in the engine, and no KV held for one (a cancelled response's request was aborted)."""
    deadline = time.monotonic() + timeout
    while (info := httpx.get(server.url + "/server_info").json())["num_running_requests"] or info["kv_cache"][
        "in_use_tokens"
    ]:
        assert time.monotonic() < deadline, info
        time.sleep(0.05)


def test_background_response_is_polled_until_final_then_continued(client: openai.OpenAI) -> None:
    created = client.responses.create(
        model=MODEL, input=QUESTION, instructions=BRIEF, max_output_tokens=24, temperature=0, background=True
    )
    assert created.status == "queued" and created.background is True and created.output == []
    done = _settle(client, created.id)
    assert done.status in ("completed", "incomplete") and done.background is True
    assert "Paris" in done.output_text and 0 < done.usage.output_tokens <= 24
    # A final background response is a stored one: cancelling it returns it as it ended; it can be continued.
    assert client.responses.cancel(created.id).status == done.status
    follow = client.responses.create(
        model=MODEL, input="And of Italy?", previous_response_id=created.id, max_output_tokens=8, temperature=0
    )
    assert follow.usage.input_tokens_details.cached_tokens > 0


def test_background_stream_survives_its_client_and_resumes_at_any_event(
    server: ServerThread, client: openai.OpenAI
) -> None:
    stream = client.responses.create(
        model=MODEL, input=STORY, max_output_tokens=120, temperature=0, background=True, stream=True
    )
    head = []
    for event in stream:
        head.append(event)
        if len(head) == 8:
            break
    stream.close()  # the client goes away: the response runs on
    rid = head[0].response.id
    assert [e.type for e in head[:2]] == ["response.created", "response.in_progress"]
    assert head[0].response.status == "queued" and head[1].response.status == "in_progress"
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=head[-1].sequence_number))
    events = head + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text and final.usage.output_tokens > 8
    assert client.responses.retrieve(rid).output_text == final.output_text
    # Once final, the whole stream is replayed from the store, from the start when no event is named.
    replayed = list(client.responses.retrieve(rid, stream=True))
    assert [e.sequence_number for e in replayed] == list(range(len(events)))
    r = httpx.get(f"{server.url}/v1/responses/{rid}", params={"stream": "true", "starting_after": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "starting_after"


def test_cancel_stops_a_background_response_and_frees_its_kv(server: ServerThread, client: openai.OpenAI) -> None:
    created = client.responses.create(model=MODEL, input=STORY, max_output_tokens=1500, temperature=0, background=True)
    cancelled = client.responses.cancel(created.id)
    assert cancelled.status == "cancelled" and cancelled.id == created.id
    assert all(item.status == "incomplete" for item in cancelled.output)
    _idle(server)
    # Cancelling again, and retrieving, give the same final response.
    again = client.responses.cancel(created.id)
    assert again.status == "cancelled" and again.output_text == cancelled.output_text
    assert client.responses.retrieve(created.id).status == "cancelled"


def test_only_background_responses_are_cancelled_or_streamed_again(server: ServerThread, client: openai.OpenAI) -> None:
    plain = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, temperature=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.cancel(plain.id)
    assert "background" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        list(client.responses.retrieve(plain.id, stream=True))
    assert err.value.body["param"] == "stream"
    polled = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, background=True)
    with pytest.raises(openai.BadRequestError):  # created without stream: its events were not kept
        list(client.responses.retrieve(_settle(client, polled.id).id, stream=True))
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_missing")
    # A response running for its caller (streamed here) is not stored yet: cancelling it is refused as OpenAI
    # refuses it (400), not "not found".
    stream = client.responses.create(model=MODEL, input=STORY, max_output_tokens=200, temperature=0, stream=True)
    running = next(iter(stream)).response.id
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.cancel(running)
    assert "background" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.delete(running)
    assert "still running" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="and then?", previous_response_id=running, max_output_tokens=2)
    assert "still running" in err.value.body["message"]
    stream.close()
    _idle(server)


def test_a_background_response_running_at_shutdown_ends_incomplete_and_stored(engine: Engine) -> None:
    """No connection waits for a background response: the shutdown gives it the grace period, then aborts its
    request, and it ends ``incomplete``, stored (it used to be cancelled at once, as the event loop closed)."""
    app = create_app(engine, ServerConfig(served_model_name=MODEL, shutdown_grace_period=0.5))
    with ServerThread(app) as srv:
        body = {"model": MODEL, "input": STORY, "max_output_tokens": 1500, "temperature": 0, "background": True}
        rid = httpx.post(srv.url + "/v1/responses", json=body, timeout=30).json()["id"]
        time.sleep(0.2)
    stored = app.state.server.responses.get(rid)
    assert stored is not None and stored.response["status"] == "incomplete"
    assert stored.response["incomplete_details"] == {"reason": "interrupted"}
    assert stored.response["usage"]["output_tokens"] > 0
    assert engine.check_kv()["in_use_tokens"] == 0
