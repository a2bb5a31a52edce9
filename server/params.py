"""Turn API request parameters into ``SamplingParams``, with 400s that name the parameter a client sent.

The ranges themselves are checked by ``SamplingParams.validate`` (shared with the in-process API); here we
check what only the server knows: the parameter spelling and the prompt's share of the context. A grammar
constraint (``regex``, ``json_schema``, ...) is read by ``server.constraints`` and set on ``params.constraint``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from radixserve.constrained import ConstraintSpec
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.server.constraints import CONSTRAINT_FIELDS, native_constraint
from radixserve.server.errors import bad_request, from_engine_error
from radixserve.server.protocol import ChatCompletionRequest, CompletionRequest
from radixserve.server.tokens import encode

_NATIVE_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} - {
    "return_logprob",
    "top_logprobs_num",
    "logprob_start_len",
    "constraint",  # set from the constraint fields (regex, json_schema, ...), never as a raw value
}
# SGLang sampling_params keys that are spelled differently here.
_NATIVE_ALIASES = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "no_stop_trim": "include_stop_str_in_output",
}
# Sizes beyond what any client needs, bounding the per-token work one request can cause (stop strings are
# searched after every token, stop ids and biases are applied to every step's logits).
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
MAX_BAD_WORDS = 256
MAX_BAD_WORD_TOKENS = 64


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


_TOKEN_ID = re.compile(r"-?[0-9]{1,12}")


def parse_logit_bias(bias: Any, param: str = "logit_bias") -> dict[int, float]:
    """``{token id: bias}`` from a JSON object whose keys are token ids written as integers."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise bad_request(f"{param} must be an object mapping token ids to biases, got {type(bias).__name__}", param)
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and _TOKEN_ID.fullmatch(key)):  # not int(): it takes " 5", "1_0", "٥"
            raise bad_request(f"{param} keys must be token ids written as integers, got {key!r}", param)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad_request(f"{param} values must be numbers, got {value!r} for token {key}", param)
        if int(key) in out:
            raise bad_request(f"{param} lists token {int(key)} twice", param)
        out[int(key)] = float(value)
    return out


def truncate_prompt(ids: list[int], keep: int | None, requested: int | None, max_context_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (the left part is cut, as a chat's
    oldest turns); -1 keeps as many as the context holds with ``requested`` new tokens (or one)."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max(1, max_context_len - (requested or 1))
    if keep < 1:
        raise bad_request("truncate_prompt_tokens must be >= 1, or -1 for as many as fit", "truncate_prompt_tokens")
    return ids[-keep:]


def budget(requested: int | None, prompt_len: int, max_context_len: int, kv_tokens: int, prompt_param: str) -> int:
    """``max_new_tokens`` for a prompt: the request's, checked against the context, or all the room left.

    OpenAI and vLLM refuse (rather than silently cut) a request whose prompt plus max_tokens exceeds the
    context; a client that wants "as much as fits" leaves max_tokens out.
    """
    room = min(max_context_len, kv_tokens) - prompt_len
    if prompt_len >= max_context_len:
        raise bad_request(
            f"the prompt has {prompt_len} tokens but this model's context length is {max_context_len} tokens; "
            "shorten the prompt",
            prompt_param,
        )
    if room < 1:  # the context has room, but the KV pool is smaller than the context
        raise bad_request(
            f"the prompt has {prompt_len} tokens, which leaves no room in the KV cache "
            f"({kv_tokens} tokens); shorten the prompt",
            prompt_param,
        )
    if requested is None:
        return room
    if prompt_len + requested > max_context_len:
        raise bad_request(
            f"this model's maximum context length is {max_context_len} tokens, but {prompt_len + requested} "
            f"were requested ({prompt_len} in the prompt, {requested} for the completion); lower max_tokens "
            "or shorten the prompt",
            "max_tokens",
        )
    return requested


def openai_params(
    req: ChatCompletionRequest | CompletionRequest,
    *,
    max_new_tokens: int,
    vocab_size: int,
    return_logprob: bool,
    top_logprobs: int,
    echo_logprobs: bool = False,
    constraint: ConstraintSpec | None = None,
    defaults: dict[str, Any] | None = None,
    tokenizer: Any = None,
    lora_name: str | None = None,
) -> list[SamplingParams]:
    """One ``SamplingParams`` per choice (``req.n`` of them); choice ``i`` gets seed ``seed + i``; every choice
    carries ``constraint``; only the first scores the prompt (``prompt_logprobs``, echo with logprobs).
    ``defaults`` (the model's generation config) fill the sampling parameters the request did not send.
    ``tokenizer`` turns ``bad_words`` into token sequences. ``lora_name``: the adapter the request's ``model``
    names."""
    if req.prompt_logprobs is not None and req.stream:
        raise bad_request("prompt_logprobs is only served without stream", "prompt_logprobs")
    if req.min_tokens > max_new_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) is larger than max_tokens ({max_new_tokens})", "min_tokens")
    sampling = _sampling_fields(req, defaults or {})
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        min_new_tokens=req.min_tokens,
        **sampling,
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        seed=req.seed,
        stop=stop_list(req.stop),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logit_bias=parse_logit_bias(req.logit_bias),
        return_logprob=return_logprob,
        # The prompt's and the answer's alternatives come from one count; each list is cut to its own on the way out.
        top_logprobs_num=max(top_logprobs, req.prompt_logprobs or 0),
        logprob_start_len=0 if echo_logprobs or req.prompt_logprobs is not None else -1,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        allowed_token_ids=_allowed_token_ids(req.allowed_token_ids),
        bad_words_ids=bad_words_ids(req.bad_words, tokenizer),
        cache_salt=req.cache_salt,
        lora_name=lora_name,
        priority=req.priority,
        constraint=constraint,
    )
    _validate(params, vocab_size, native=False)
    if req.seed is not None and req.seed + req.n > 2**63:
        raise bad_request(f"seed must be below 2**63 - n, got {req.seed}", "seed")
    seeds = [None if req.seed is None else req.seed + i for i in range(req.n)]
    choices = [dataclasses.replace(params, seed=s, stop=list(params.stop)) for s in seeds]
    if params.logprob_start_len == 0 and len(choices) > 1:
        # The prompt is every choice's: the first scores it (every row's logits, so no cached prefix), the others
        # take its KV from the cache and give their own answers' logprobs only; the routes read the prompt's from
        # the first (vLLM computes them once per request too).
        rest = {"logprob_start_len": -1, "top_logprobs_num": top_logprobs}
        choices[1:] = [dataclasses.replace(c, **rest) for c in choices[1:]]
    return choices


def _allowed_token_ids(ids: list[int] | None) -> list[int]:
    if ids is not None and not ids:
        raise bad_request(
            "allowed_token_ids must list at least one token id (leave it out to allow any)", "allowed_token_ids"
        )
    return list(ids or ())


def bad_words_ids(words: list[str] | None, tokenizer: Any) -> list[list[int]]:
    """vLLM's ``bad_words`` as token sequences: each word as it is tokenized at the start of a text and after a
    space (a word-initial token differs from a mid-text one in most vocabularies), duplicates once."""
    if not words:
        return []
    if len(words) > MAX_BAD_WORDS:
        raise bad_request(f"at most {MAX_BAD_WORDS} bad_words are allowed, got {len(words)}", "bad_words")
    out: list[list[int]] = []
    for word in words:
        if not word.strip():
            raise bad_request("bad_words must be non-empty words", "bad_words")
        first = encode(tokenizer, word.lstrip(), add_special_tokens=False)
        spaced = encode(tokenizer, " " + word.lstrip(), add_special_tokens=False)
        # As vLLM: the spaced form only when it is a word of its own (as many tokens, another first one).
        for ids in (first, spaced) if len(spaced) == len(first) and spaced[0] != first[0] else (first,):
            if ids not in out:
                out.append(ids)
    return out


# Sampling parameters a generation config may give defaults for, with the server's own default.
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def _sampling_fields(req: ChatCompletionRequest | CompletionRequest, defaults: dict[str, Any]) -> dict[str, Any]:
    """Each sampling parameter as the request sent it, else the model's default, else the server's."""
    sent = req.model_fields_set
    return {
        name: getattr(req, name) if name in sent and getattr(req, name) is not None else defaults.get(name, fallback)
        for name, fallback in SAMPLING_DEFAULTS.items()
    }


def native_params(
    raw: dict[str, Any] | None,
    *,
    return_logprob: bool,
    top_logprobs_num: int,
    logprob_start_len: int,
    vocab_size: int,
    defaults: dict[str, Any] | None = None,
    priority: int | None = None,
) -> SamplingParams:
    """``SamplingParams`` from an SGLang-style ``sampling_params`` dict; unknown keys are a 400, not ignored,
    because a misspelt sampling parameter silently changes what is generated. The constraint fields (``regex``,
    ``json_schema``, ``ebnf``/``grammar``, ``choices``; at most one) set ``constraint``, checked for shape only:
    the route compiles it before submitting. ``defaults`` fill the sampling parameters the dict leaves out."""
    raw = dict(raw or {})
    constraint = native_constraint(raw)
    raw = {_NATIVE_ALIASES.get(k, k): v for k, v in raw.items() if k not in CONSTRAINT_FIELDS}
    for key, value in (defaults or {}).items():
        if raw.get(key) is None:
            raw[key] = value
    unknown = sorted(set(raw) - _NATIVE_FIELDS)
    if unknown:
        raise bad_request(
            f"unknown sampling parameter(s) {', '.join(unknown)}; known: {', '.join(sorted(_NATIVE_FIELDS))}",
            f"sampling_params.{unknown[0]}",
        )
    if isinstance(raw.get("stop"), str):
        raw["stop"] = [raw["stop"]]
    if "logit_bias" in raw:
        raw["logit_bias"] = parse_logit_bias(raw["logit_bias"], "sampling_params.logit_bias")
    try:
        params = SamplingParams(**raw)
        params.return_logprob = return_logprob
        params.top_logprobs_num = top_logprobs_num
        params.logprob_start_len = logprob_start_len
        if priority is not None:  # SGLang sends it beside sampling_params (the request's, not a sampling one)
            params.priority = priority
        params.constraint = constraint.spec if constraint is not None else None
        _check_types(params)
    except (TypeError, ValueError) as exc:
        raise bad_request(f"invalid sampling_params: {exc}", "sampling_params") from None
    _validate(params, vocab_size, native=True)
    return params


def _check_types(params: SamplingParams) -> None:
    """Catch wrongly typed values early: the engine thread must never see, say, a string temperature."""
    for f in dataclasses.fields(SamplingParams):
        value = getattr(params, f.name)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if f.name == "seed":
            ok = value is None or (isinstance(value, int) and not isinstance(value, bool))
        elif isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if ok:
                setattr(params, f.name, float(value))
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif f.name == "stop":
            ok = isinstance(value, list) and all(isinstance(s, str) for s in value)
        elif f.name in ("stop_token_ids", "allowed_token_ids"):
            ok = isinstance(value, list) and all(_is_int(t) for t in value)
        elif f.name == "bad_words_ids":
            ok = isinstance(value, list) and all(isinstance(q, list) and all(_is_int(t) for t in q) for q in value)
        else:
            ok = True
        if not ok:
            raise TypeError(f"{f.name} has the wrong type ({type(value).__name__}: {value!r})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validate(params: SamplingParams, vocab_size: int, native: bool) -> None:
    prefix = "sampling_params." if native else ""
    params.allowed_token_ids = sorted(set(params.allowed_token_ids))  # (each id once: the sampler's work per step)
    checked = [("stop_token_ids", params.stop_token_ids), ("logit_bias", list(params.logit_bias))]
    checked += [("allowed_token_ids", params.allowed_token_ids)]
    for name, ids in checked:
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:  # checked here too, to name the parameter
            raise bad_request(f"{name}: token id {bad} is out of range [0, {vocab_size})", prefix + name)
    try:
        params.validate(vocab_size)
    except ValueError as exc:
        raise from_engine_error(exc, native) from None
    longest = max((len(s) for s in params.stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise bad_request(f"stop strings may be at most {MAX_STOP_CHARS} characters, got {longest}", prefix + "stop")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(
            f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(params.stop_token_ids)}",
            prefix + "stop_token_ids",
        )
    if len(params.bad_words_ids) > 2 * MAX_BAD_WORDS or any(len(q) > MAX_BAD_WORD_TOKENS for q in params.bad_words_ids):
        raise bad_request(
            f"at most {MAX_BAD_WORDS} bad words of at most {MAX_BAD_WORD_TOKENS} tokens each are allowed",
            prefix + ("bad_words_ids" if native else "bad_words"),
        )
    if len(params.logit_bias) > MAX_LOGIT_BIAS:
        raise bad_request(
            f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(params.logit_bias)}", prefix + "logit_bias"
        )
