"""``POST /v1/completions``: OpenAI (legacy) text completions, with batched prompts, echo and logprobs.

Choice ``p * n + j`` is the ``j``-th sample of prompt ``p``, as OpenAI orders them. ``max_tokens`` defaults to
16 as in OpenAI's API. ``echo`` with ``logprobs`` returns the prompt tokens' log-probabilities too (the first
prompt token has none), which is how evaluation harnesses score text with ``max_tokens=0``. The constraint
fields (``regex``, ``json_schema``, ``ebnf``/``grammar``, ``choices``) apply to every choice of every prompt; the
grammar is compiled before anything is submitted (see ``server.constraints``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request

from radixserve.runtime.request import ReqOutput
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.server.chat_core import finish_reason, usage
from radixserve.server.constraints import (
    at_most_one,
    body_constraints,
    compile_constraints,
    response_format_constraint,
)
from radixserve.server.deps import StateDep, require_api_key
from radixserve.server.engine_client import RequestGroup, Result
from radixserve.server.errors import bad_request
from radixserve.server.extra_fields import check_extra_fields
from radixserve.server.logprobs import completion_logprobs, prompt_entries, vllm_prompt_logprobs
from radixserve.server.params import budget, openai_params, truncate_prompt
from radixserve.server.protocol import CompletionRequest, usage_in_stream
from radixserve.server.state import ServerState
from radixserve.server.streaming import DONE, SSEResponse, stream_chunk
from radixserve.server.tokens import TokenIdNames, item_ids, prompt_items

router = APIRouter(dependencies=[Depends(require_api_key)], tags=["OpenAI"])

DEFAULT_MAX_TOKENS = 16


def _prompts(req: CompletionRequest, tokenizer: Any, vocab_size: int) -> list[tuple[list[int], str]]:
    """``(token ids, text)`` per prompt; the text is what ``echo`` returns. Token ids are checked before they are
    decoded (the tokenizer cannot decode an id outside its vocabulary)."""
    out = []
    for k, item in enumerate(prompt_items(req.prompt, "prompt")):
        ids = item_ids(item, k, tokenizer, vocab_size, True, "prompt")
        out.append((ids, item if isinstance(item, str) else tokenizer.decode(ids, skip_special_tokens=False)))
    return out


@router.post("/v1/completions", summary="Create a text completion (OpenAI-compatible)")
async def completions(body: CompletionRequest, request: Request, state: StateDep):
    check_extra_fields(body, "/v1/completions")
    engine = state.ready_engine()  # (first: while loading, an adapter's name is not known yet)
    lora = state.check_model(body.model)
    constraint = at_most_one([*body_constraints(body), response_format_constraint(body.response_format)])
    if body.suffix:
        raise bad_request("suffix is not supported by this server", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of is not supported (only best_of equal to n)", "best_of")
    want_lps = body.logprobs is not None
    if body.stream and body.echo and want_lps:
        raise bad_request("echo with logprobs is only supported without stream", "echo")
    prompts = _prompts(body, engine.tokenizer, engine.vocab_size)
    requests: list[tuple[list[int], SamplingParams, str | None]] = []
    cid = f"cmpl-{uuid.uuid4().hex}"
    for p, (ids, _) in enumerate(prompts):
        if body.truncate_prompt_tokens is not None:
            ids = truncate_prompt(ids, body.truncate_prompt_tokens, body.max_tokens, engine.max_context_len)
            prompts[p] = (ids, engine.tokenizer.decode(ids, skip_special_tokens=False))
        requested = body.max_tokens
        if requested is None:
            room = min(engine.max_context_len, state.kv_total_tokens) - len(ids)
            requested = max(0, min(DEFAULT_MAX_TOKENS, room)) if room > 0 else None
        max_new = budget(requested, len(ids), engine.max_context_len, state.kv_total_tokens, "prompt")
        params = openai_params(
            body,
            max_new_tokens=max_new,
            vocab_size=engine.vocab_size,
            return_logprob=want_lps,
            top_logprobs=body.logprobs or 0,
            echo_logprobs=body.echo and want_lps,
            constraint=constraint.spec if constraint is not None else None,
            defaults=state.sampling_defaults,
            tokenizer=engine.tokenizer,
            lora_name=lora,
        )
        requests.extend((ids, sp, f"{cid}-{p * body.n + j}") for j, sp in enumerate(params))
    await compile_constraints(engine, state.metrics, [constraint])
    group = RequestGroup(engine, state.metrics, state.inflight, name=cid)
    group.submit(requests)
    created = int(time.time())
    if body.stream:
        return SSEResponse(_stream(group, body, state, prompts, cid, created, lora or state.served_name))
    results = await group.collect(request)
    choices = []
    for i, res in enumerate(results):
        ids, text = prompts[i // body.n]
        scored = results[i - i % body.n].prompt_logprobs  # (the prompt's first choice scored it for them all)
        choices.append(_choice(i, res, body, state, ids, text, scored))
    return {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": lora or state.served_name,
        "choices": choices,
        "usage": _usage(results, body.n),
    }


def _usage(results: list[Result] | list[ReqOutput], n: int) -> dict[str, Any]:
    """Each prompt's tokens count once however many samples it has (OpenAI's convention)."""
    firsts = results[::n]
    return usage(
        sum(r.prompt_tokens for r in firsts),
        sum(r.completion_tokens for r in results),
        sum(r.cached_tokens for r in firsts),
    )


def _choice(
    index: int,
    res: Result,
    body: CompletionRequest,
    state: ServerState,
    prompt_ids: list[int],
    prompt_text: str,
    prompt_lps: list[Any] | None,
) -> dict[str, Any]:
    reason = finish_reason(res.finish_reason, res.error, res.error_code)
    text = prompt_text + res.text if body.echo else res.text
    logprobs = None
    if body.logprobs is not None:
        assert state.token_names is not None
        tokens: list[int] = list(res.token_ids)
        lps: list[Any] = list(res.logprobs)
        if body.echo:
            tokens = prompt_ids + tokens
            lps = prompt_entries(prompt_ids, prompt_lps) + lps
        logprobs = completion_logprobs(tokens, lps, state.token_names, shown=_shown(body), top_n=body.logprobs)
    choice = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": reason,
        "matched_stop": res.matched_stop,
    }
    if body.prompt_logprobs is not None:  # vLLM's
        assert state.token_names is not None
        names = _shown(body) or state.token_names
        choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt_lps, names, body.prompt_logprobs)
    return choice


async def _stream(
    group: RequestGroup,
    body: CompletionRequest,
    state: ServerState,
    prompts: list[tuple[list[int], str]],
    cid: str,
    created: int,
    model: str,
) -> AsyncIterator[str]:
    names = state.token_names
    assert names is not None
    offsets = [0] * len(group.rids)
    include_usage, continuous = usage_in_stream(body.stream_options)

    def chunk(choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None) -> str:
        return stream_chunk(cid, "text_completion", created, model, choices, usage_, include_usage)

    finals: list[ReqOutput | None] = [None] * len(group.rids)
    try:
        if body.echo:
            for i in range(len(group.rids)):
                text = prompts[i // body.n][1]
                offsets[i] = len(text)
                yield chunk([{"index": i, "text": text, "logprobs": None, "finish_reason": None}])
        async for i, out in group:
            reason = finish_reason(out.finish_reason, out.error, out.error_code) if out.finished else None
            lps = None
            if body.logprobs is not None and out.logprobs:
                lps = completion_logprobs(out.token_ids, out.logprobs, names, offsets[i], _shown(body), body.logprobs)
            offsets[i] += len(out.text)
            if out.text or lps or out.finished:
                # continuous_usage_stats (vLLM's): each chunk counts its choice's tokens so far.
                so_far = usage(out.prompt_tokens, out.completion_tokens, out.cached_tokens) if continuous else None
                yield chunk([{"index": i, "text": out.text, "logprobs": lps, "finish_reason": reason}], so_far)
            if out.finished:
                finals[i] = out
        if include_usage:
            yield chunk([], _usage([f for f in finals if f is not None], body.n))
        yield DONE
    finally:
        group.close()


def _shown(body: CompletionRequest) -> TokenIdNames | None:
    """``"token_id:<id>"`` names for the logprobs' tokens (``return_tokens_as_token_ids``), else their text."""
    return TokenIdNames() if body.return_tokens_as_token_ids else None
