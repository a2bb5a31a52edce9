"""``POST /v1/chat/completions``: OpenAI chat completions, streamed or not, with n choices and tool calls.

Tool calls: with ``tool_choice`` "auto" (or absent) they are parsed from the answer's text
(``server.tool_parser``); with "required" or a named function the output is constrained to the call's JSON
(``server.tool_calls``), so the message is always ``tool_calls`` (content null, finish_reason "tool_calls",
or "length" when max_tokens cut it). "auto" with a ``response_format`` constrains the output to either tool-call
blocks or the formatted answer, and parses it as "auto" does. ``response_format`` and the constraint fields are
enforced by a grammar (``server.constraints``), compiled before the request is submitted. With
``--reasoning-parser`` the think section is ``reasoning_content`` (``delta.reasoning_content`` when streamed).

The turn itself runs in ``server.chat_core``, shared with the Responses and Messages APIs; this module is the
Chat Completions wire format of its results and events.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request

from radixserve.server.chat_core import (
    ChatChoice,
    ChatRun,
    ChoiceDone,
    TextDelta,
    ToolDelta,
    events,
    start_chat,
    usage,
)
from radixserve.server.chat_core import collect as collect_choices
from radixserve.server.deps import StateDep, require_api_key
from radixserve.server.extra_fields import check_extra_fields
from radixserve.server.logprobs import chat_logprobs, vllm_prompt_logprobs
from radixserve.server.protocol import ChatCompletionRequest, usage_in_stream
from radixserve.server.state import ServerState
from radixserve.server.streaming import DONE, SSEResponse, stream_chunk
from radixserve.server.tokens import TokenIdNames, TokenNames

router = APIRouter(dependencies=[Depends(require_api_key)], tags=["OpenAI"])


@router.post("/v1/chat/completions", summary="Create a chat completion (OpenAI-compatible)")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: StateDep):
    check_extra_fields(body, "/v1/chat/completions")
    run = await start_chat(body, state)
    if body.stream:
        return SSEResponse(_stream(run, body, state))
    choices = await collect_choices(run, request)
    results = [c.result for c in choices]
    response = {
        "id": run.id,
        "object": "chat.completion",
        "created": run.created,
        "model": run.model,
        "choices": [_choice(c, body, state) for c in choices],
        "usage": usage(results[0].prompt_tokens, sum(r.completion_tokens for r in results), results[0].cached_tokens),
    }
    if body.prompt_logprobs is not None:  # vLLM's: the prompt is every choice's
        response["prompt_logprobs"] = vllm_prompt_logprobs(
            results[0].prompt_logprobs, _names(state, body), body.prompt_logprobs
        )
    return response


def _choice(choice: ChatChoice, body: ChatCompletionRequest, state: ServerState) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": choice.content}
    if choice.reasoning is not None:
        message["reasoning_content"] = choice.reasoning
    if choice.tool_calls:
        message["tool_calls"] = [c.to_openai() for c in choice.tool_calls]
    assert state.token_names is not None
    res = choice.result
    return {
        "index": choice.index,
        "message": message,
        "logprobs": chat_logprobs(res.logprobs, _names(state, body), body.top_logprobs or 0) if body.logprobs else None,
        "finish_reason": choice.finish_reason,
        "matched_stop": res.matched_stop,
    }


async def _stream(run: ChatRun, body: ChatCompletionRequest, state: ServerState) -> AsyncIterator[str]:
    """Per choice: a first delta with the role, content (or reasoning_content) deltas, a last chunk with
    finish_reason; then the usage chunk (if asked for) and [DONE]. Choices interleave as their tokens arrive. A
    forced tool call streams tool-call deltas instead of content: index, id and name first, then argument
    fragments."""
    names = _names(state, body)
    include_usage, continuous = usage_in_stream(body.stream_options)

    def chunk(choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None) -> str:
        return stream_chunk(
            run.id, "chat.completion.chunk", run.created, run.model, choices, usage_, include_usage
        )

    def delta(index: int, d: dict[str, Any], logprobs: Any = None, reason: str | None = None, out: Any = None) -> str:
        # continuous_usage_stats (vLLM's): each chunk counts its choice's tokens so far.
        so_far = usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens) if continuous and out else None
        return chunk([{"index": index, "delta": d, "logprobs": logprobs, "finish_reason": reason}], so_far)

    finals = []
    try:
        for i in range(run.n):
            yield delta(i, {"role": "assistant", "content": None if run.tools.forced else ""})
        async for event in events(run):
            if isinstance(event, ChoiceDone):  # (its tokens' logprobs went out with their deltas)
                finals.append(event.output)
                yield delta(event.index, {}, None, event.finish_reason, event.output)
                continue
            lps = (
                chat_logprobs(event.logprobs, names, body.top_logprobs or 0)
                if body.logprobs and event.logprobs
                else None
            )
            if isinstance(event, TextDelta):
                key = "reasoning_content" if event.kind == "reasoning" else "content"
                yield delta(event.index, {key: event.text}, lps, None, event.output)
            elif isinstance(event, ToolDelta):
                yield delta(event.index, {"tool_calls": [event.to_openai()]}, lps, None, event.output)
        if include_usage:
            out = finals[0]
            yield chunk([], usage(out.prompt_tokens, sum(f.completion_tokens for f in finals), out.cached_tokens))
        yield DONE
    finally:
        run.group.close()  # also when the client left before the first event


def _names(state: ServerState, body: ChatCompletionRequest) -> TokenNames | TokenIdNames:
    """How logprobs name tokens: by their text, or ``"token_id:<id>"`` (``return_tokens_as_token_ids``)."""
    assert state.token_names is not None
    return TokenIdNames() if body.return_tokens_as_token_ids else state.token_names
