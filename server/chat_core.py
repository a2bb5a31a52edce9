"""One chat turn through the engine, for every chat-style API: Chat Completions, Responses and Messages.

Each HTTP API is a thin adapter: it turns its body into the internal request model (``ChatCompletionRequest``),
calls ``start_chat``, and formats what comes back, either ``collect``'s finished ``ChatChoice`` list or the
typed events of ``events`` (``TextDelta``, ``ToolDelta``, ``ChoiceDone``). Everything between is shared: the
constraint of the request (response format, forced tool calls, the union of both, the think section of a
reasoning model), the prompt's budget, submission, and the reading of the output into reasoning, content and tool
calls.

Invariants: a choice's output is read by one ``_ChoiceReader`` whether it streams or not, so the streamed parts
joined equal the non-streamed fields; the reasoning split comes first and tool calls are read from the content
only; a forced call (``tool_choice`` required or named) is read by ``ToolCallScanner``, an offered one by
``ToolCallStream``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from radixserve.constrained.reasoning_grammar import answer_spec
from radixserve.runtime.request import FinishReason, ReqOutput, TokenLogprob
from radixserve.server.chat import content_text
from radixserve.server.constraints import (
    RequestConstraint,
    at_most_one,
    body_constraints,
    compile_constraints,
    response_format_constraint,
)
from radixserve.server.engine_client import RequestGroup, Result
from radixserve.server.errors import bad_request, request_failed
from radixserve.server.params import budget, openai_params, truncate_prompt
from radixserve.server.protocol import ChatCompletionRequest
from radixserve.server.reasoning import ReasoningFormat, ReasoningSplitter, reasoning_constraint
from radixserve.server.state import ServerState
from radixserve.server.tokens import encode
from radixserve.server.tool_calls import ToolCallScanner, forced_tool_constraint, tool_or_answer_constraint
from radixserve.server.tool_parser import ParsedToolCall, ToolCallStream


def finish_reason(reason: FinishReason | None, error: str | None, code: str | None = None) -> str:
    """OpenAI's finish_reason for an engine one; a request that failed in the engine is an error for it alone."""
    if reason == FinishReason.ERROR:
        raise request_failed(error, code)
    return reason.value if reason is not None else FinishReason.ABORT.value


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True)
class ToolOutput:
    """How an answer's tool calls are read: ``names`` offered (empty: none are read), ``forced`` (the output is the
    call JSON itself, ``server.tool_calls``), ``bare_json`` (a bare JSON object may be a call; not under the union
    grammar, where it is the answer), ``parallel`` (false: ``parallel_tool_calls: false``, at most the first call
    the model wrote is returned; forced calls are held to one by their grammar instead)."""

    names: frozenset[str] = frozenset()
    forced: bool = False
    bare_json: bool = True
    parallel: bool = True


@dataclass(frozen=True)
class Thinking:
    """The think section of a reasoning model's answer: its format, and whether the prompt opened it."""

    fmt: ReasoningFormat
    opened: bool


@dataclass
class ChatRun:
    """A submitted chat turn: its requests (one per choice) and how their output is read."""

    group: RequestGroup
    tools: ToolOutput
    thinking: Thinking | None
    id: str
    created: int
    prompt_tokens: int
    model: str  # the name responses report: the served name, or the LoRA adapter the request named

    @property
    def n(self) -> int:
        return len(self.group.rids)


# ------------------------------------------------------------------------------------------------ events
@dataclass
class TextDelta:
    """New text of choice ``index``: ``kind`` "reasoning" or "content"; ``logprobs`` of the tokens it came with."""

    index: int
    kind: str
    text: str
    logprobs: list[TokenLogprob] | None = None
    output: ReqOutput | None = None  # the engine output it came from (token counts, cache hit)


@dataclass
class ToolDelta:
    """Part of tool call ``call`` of choice ``index``: the first carries ``id`` and ``name``, later ones only more
    ``arguments`` text (the fragments joined are the call's arguments)."""

    index: int
    call: int
    arguments: str
    id: str | None = None
    name: str | None = None
    logprobs: list[TokenLogprob] | None = None
    output: ReqOutput | None = None  # the engine output it came from (token counts, cache hit)

    def to_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.call, "function": {"arguments": self.arguments}}
        function = {"name": self.name, "arguments": self.arguments}
        return {"index": self.call, "id": self.id, "type": "function", "function": function}


@dataclass
class ChoiceDone:
    """Choice ``index`` finished; ``finish_reason`` is OpenAI's ("tool_calls" when it made calls)."""

    index: int
    finish_reason: str
    output: ReqOutput


Event = TextDelta | ToolDelta | ChoiceDone


@dataclass
class ChatChoice:
    """A finished choice, read as ``events`` would have streamed it."""

    index: int
    content: str | None
    reasoning: str | None
    tool_calls: list[ParsedToolCall]
    finish_reason: str
    result: Result


# ------------------------------------------------------------------------------------------------ start
def check_options(req: ChatCompletionRequest) -> tuple[RequestConstraint | None, bool]:
    """``(the request's constraint, whether it forces tool calls)``; at most one constraint per request."""
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    tool = forced_tool_constraint(req)
    fmt = response_format_constraint(req.response_format)  # validated even when unused: malformed stays a 400
    if tool is not None:
        # As in OpenAI's API, response_format governs a content answer only, and a forced call never gives one.
        fmt = None
    constraint = at_most_one([*body_constraints(req), fmt, tool])
    if constraint is not None and constraint is not tool and constraint.spec.kind in ("json_schema", "json_object"):
        # "auto" with a JSON format (response_format, guided_json, ...): a call is still possible, so the answer's
        # format joins it.
        constraint = tool_or_answer_constraint(req, constraint) or constraint
    return constraint, tool is not None


async def start_chat(body: ChatCompletionRequest, state: ServerState, prompt_param: str = "messages") -> ChatRun:
    """Validate, render and submit ``body``; every client mistake is an ``APIError`` before anything runs."""
    engine = state.ready_engine()  # (first: while loading, an adapter's name is not known yet)
    lora = state.check_model(body.model)
    constraint, forced = check_options(body)
    text, parse_tools = state.render_chat(body)
    thinking = None
    if state.reasoning_format is not None:
        last = len(body.messages) - 1
        prefill = (content_text(body.messages[last], last) or "") if body.continue_final_message else None
        thinking = Thinking(state.reasoning_format, state.reasoning_format.opened_in(text, prefill))
    union = constraint is not None and answer_spec(constraint.spec).kind == "tool_or_answer"
    if thinking is not None:
        cap = body.max_thinking_tokens or state.config.reasoning_max_tokens or None
        constraint = reasoning_constraint(constraint, thinking.fmt, thinking.opened, cap)
    elif body.max_thinking_tokens is not None:
        raise bad_request(
            "max_thinking_tokens needs a reasoning model: start the server with --reasoning-parser",
            "max_thinking_tokens",
        )
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    prompt_ids = encode(engine.tokenizer, text, add_special_tokens=False)
    prompt_ids = truncate_prompt(prompt_ids, body.truncate_prompt_tokens, requested, engine.max_context_len)
    max_new = budget(requested, len(prompt_ids), engine.max_context_len, state.kv_total_tokens, prompt_param)
    params = openai_params(
        body,
        max_new_tokens=max_new,
        vocab_size=engine.vocab_size,
        return_logprob=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        constraint=constraint.spec if constraint is not None else None,
        defaults=state.sampling_defaults,
        tokenizer=engine.tokenizer,
        lora_name=lora,
    )
    await compile_constraints(engine, state.metrics, [constraint])
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    group = RequestGroup(engine, state.metrics, state.inflight, name=cid)
    group.submit([(prompt_ids, p, f"{cid}-{i}") for i, p in enumerate(params)])
    names = frozenset(t.function.name for t in body.tools or []) if parse_tools and not forced else frozenset()
    tools = ToolOutput(names, forced, bare_json=not union, parallel=body.parallel_tool_calls is not False)
    return ChatRun(group, tools, thinking, cid, int(time.time()), len(prompt_ids), lora or state.served_name)


# ------------------------------------------------------------------------------------------------ reading
@dataclass
class _ChoiceReader:
    """Reads one choice's output text into events: reasoning first, then content or tool calls."""

    index: int
    run: ChatRun
    splitter: ReasoningSplitter | None = None
    filt: ToolCallStream | None = None
    scanner: ToolCallScanner | None = None
    calls: list[ParsedToolCall] = field(default_factory=list)

    def __post_init__(self) -> None:
        thinking, tools = self.run.thinking, self.run.tools
        if thinking is not None:
            self.splitter = ReasoningSplitter(thinking.fmt, thinking.opened)
        if tools.forced:
            self.scanner = ToolCallScanner()
        elif tools.names:
            self.filt = ToolCallStream(set(tools.names), bare_json=tools.bare_json)

    def feed(self, out: ReqOutput) -> list[Event]:
        """Events of one engine output (its last included: then ``ChoiceDone`` ends them)."""
        parts = self.splitter.feed(out.text) if self.splitter is not None else [("content", out.text)]
        if out.finished and self.splitter is not None:
            parts += self.splitter.finish()
        events: list[Event] = []
        for kind, text in parts:
            events += [TextDelta(self.index, kind, text)] if kind == "reasoning" else self._content(text)
        if out.logprobs:  # on the output's first delta (an empty content delta when it has none)
            first = events[0] if events else None
            if not isinstance(first, TextDelta | ToolDelta):
                first = TextDelta(self.index, "content", "")
                events.insert(0, first)
            first.logprobs = out.logprobs
        if out.finished:
            reason = finish_reason(out.finish_reason, out.error, out.error_code)
            events += self._finish()
            if self.calls and (self.scanner is None or self.scanner.complete):
                reason = "tool_calls"  # a forced call cut by max_tokens keeps "length"
            events.append(ChoiceDone(self.index, reason, out))
        for event in events:
            if isinstance(event, TextDelta | ToolDelta):
                event.output = out
        return events

    def _content(self, text: str) -> list[Event]:
        if self.scanner is not None:
            return [self._tool_delta(d) for d in self.scanner.feed(text)]
        if self.filt is not None:
            text = self.filt.feed(text)
        return [TextDelta(self.index, "content", text)] if text else []

    def _finish(self) -> list[Event]:
        if self.scanner is not None:
            self.calls = self.scanner.finish()
            if not self.calls and self.scanner.text:  # cut before a name was complete: the text is content
                return [TextDelta(self.index, "content", self.scanner.text)]
            return []
        if self.filt is None:
            return []
        rest, self.calls = self.filt.finish()
        if not self.run.tools.parallel:
            self.calls = self.calls[:1]
        events: list[Event] = [TextDelta(self.index, "content", rest)] if rest else []
        for k, call in enumerate(self.calls):
            events.append(ToolDelta(self.index, k, call.arguments, call.id, call.name))
        return events

    def _tool_delta(self, d: dict[str, Any]) -> ToolDelta:
        function = d["function"]
        if "id" in d:
            return ToolDelta(self.index, d["index"], function["arguments"], d["id"], function["name"])
        return ToolDelta(self.index, d["index"], function["arguments"])


async def events(run: ChatRun) -> AsyncIterator[Event]:
    """The run's events as its tokens arrive (choices interleaved); closes the group at the end or on exit."""
    readers = [_ChoiceReader(i, run) for i in range(run.n)]
    try:
        async for i, out in run.group:
            for event in readers[i].feed(out):
                yield event
    finally:
        run.group.close()


async def collect(run: ChatRun, request: Request) -> list[ChatChoice]:
    """Every choice once finished (aborted if the client disconnects first)."""
    results = await run.group.collect(request)
    choices = []
    for i, res in enumerate(results):
        reader = _ChoiceReader(i, run)
        final = ReqOutput(
            rid=run.group.rids[i],
            text=res.text,
            token_ids=[],
            logprobs=[],
            finished=True,
            finish_reason=res.finish_reason,
            error=res.error,
            error_code=res.error_code,
        )
        content, reason = "", ""
        for event in reader.feed(final):
            if isinstance(event, TextDelta) and event.kind == "content":
                content += event.text
            elif isinstance(event, ChoiceDone):
                reason = event.finish_reason
        reasoning = reader.splitter.reasoning if reader.splitter is not None else None
        text = None if reader.calls and not content.strip() else content
        choices.append(ChatChoice(i, text, reasoning, reader.calls, reason, res))
    return choices
