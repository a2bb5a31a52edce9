"""Request bodies of the HTTP API as pydantic models, so FastAPI validates them and /openapi.json describes them.

Unknown top-level fields are kept (``model_extra``) for ``server.extra_fields``, which refuses those that would
change the output and logs the rest (clients send ``store``, ``metadata``, ``user``, ...). Range checks of
sampling parameters live in ``SamplingParams.validate`` (one place for every entry point); these models only
check types and the few things that are about the request's shape.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from radixserve.runtime.sampling_params import MAX_TOP_LOGPROBS

MAX_N = 64  # choices per prompt; each is a separate request in the engine


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _NullIsDefault(BaseModel):
    """A top-level ``null`` means "use the default": many client libraries send every known field. Unknown
    fields are kept in ``model_extra`` (see ``server.extra_fields``)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class ContentPart(BaseModel):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is served."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """A chat message. ``role`` is checked against the served roles when the prompt is rendered."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        """A call's arguments are a JSON object (clients pass them as keyword arguments): a schema of anything
        else is refused; one without a type (``{}``: no parameters declared) is read as an object's."""
        kind = (parameters or {}).get("type")
        if kind is not None and "object" not in (kind if isinstance(kind, list) else [kind]):
            raise ValueError(f"a tool's parameters must be the JSON schema of an object, not of type {kind!r}")
        return parameters


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: dict[str, Any]


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class StreamOptions(_Lenient):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk's usage counts the tokens so far (not null until the last chunk).
    continuous_usage_stats: bool = False


def usage_in_stream(options: StreamOptions | None) -> tuple[bool, bool]:
    """``(every chunk carries usage, counting as it goes)`` from a request's ``stream_options``."""
    if options is None or not options.include_usage:
        return False, False
    return True, options.continuous_usage_stats


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: one of ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object``, served
    as the constraint fields below are. Unknown keys are a 400 (a misspelt key would leave the output free)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # Accepted so that a request naming them gets a 400 saying why rather than one about an unknown key.
    structural_tag: Any = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    # Choices of vLLM's own machinery, with no effect on what a grammar allows.
    backend: str | None = None
    disable_fallback: bool | None = None


class _SamplingFields(_NullIsDefault):
    """Parameters shared by /v1/chat/completions and /v1/completions, OpenAI's and the common extensions."""

    model: str | None = Field(None, description="The served model name (or the --model value).")
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, description="Per-choice seeds are seed, seed+1, ... so choices differ.")
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string) -> bias in [-100, 100].")
    stream: bool = False
    stream_options: StreamOptions | None = None
    # SGLang / vLLM extensions.
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = Field(False, description="Keep a matched stop string at the end of the text.")
    allowed_token_ids: list[int] | None = Field(None, description="Only these tokens may be generated.")
    bad_words: list[str] | None = Field(None, description="Words never generated (as vLLM bans them, by tokens).")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="Keep only the prompt's last N tokens (-1: as many as the context allows)."
    )
    return_tokens_as_token_ids: bool = Field(False, description='Logprobs name tokens "token_id:<id>".')
    priority: int = Field(0, description="With --schedule-policy priority: lower runs first.")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="The prompt tokens' logprobs with this many alternatives."
    )
    cache_salt: str | None = Field(
        None, min_length=1, description="Cached prefixes are shared only among requests with the same salt."
    )
    # Grammar-constrained decoding (at most one per request; see server/constraints.py).
    regex: str | None = Field(None, description="The output must match this regex (Rust regex syntax) in full.")
    json_schema: dict[str, Any] | bool | str | None = Field(
        None, description="The output must be JSON valid against this schema (an object, or its JSON text)."
    )
    ebnf: str | None = Field(None, description="The output must follow this Lark or GBNF/EBNF grammar.")
    grammar: str | None = Field(None, description="Same as ebnf.")
    choices: list[str] | None = Field(None, description="The output must be exactly one of these strings.")
    # vLLM's spellings of the same constraints (guided_* before vLLM 0.11, then structured_outputs).
    guided_json: dict[str, Any] | bool | str | None = Field(None, description="vLLM's name for json_schema.")
    guided_regex: str | None = Field(None, description="vLLM's name for regex.")
    guided_choice: list[str] | None = Field(None, description="vLLM's name for choices.")
    guided_grammar: str | None = Field(None, description="vLLM's name for ebnf.")
    structured_outputs: StructuredOutputs | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=0)  # (max_tokens' range: 0 is an empty answer)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(
        None, description="With a forced tool_choice: true allows several calls; absent or false forces exactly one."
    )
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template (e.g. enable_thinking)."
    )
    max_thinking_tokens: int | None = Field(
        None, ge=1, description="With --reasoning-parser: the think section is closed after this many tokens."
    )
    add_generation_prompt: bool = Field(True, description="End the prompt with the template's assistant header.")
    continue_final_message: bool = Field(
        False,
        description="Continue the last message (the assistant's, a prefill) instead of starting a new turn; "
        "needs add_generation_prompt false. The answer holds the continuation only.",
    )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = Field(None, description="As in chat (vLLM serves it here too).")
    suffix: str | None = None
    best_of: int | None = None


class PoolingInput(_NullIsDefault):
    """A pooling request's prompts (embeddings, classification): OpenAI's four ``input`` shapes, or vLLM's chat
    form, conversations rendered by the chat template: ``messages`` (one conversation, or a list of them), or a
    conversation as ``input``."""

    input: str | list[str] | list[int] | list[list[int]] | list[ChatMessage] | None = None
    messages: list[ChatMessage] | list[list[ChatMessage]] | None = None
    add_special_tokens: bool | None = Field(
        None, description="Tokenize with the model's special tokens (default: true for texts, false for chats)."
    )
    add_generation_prompt: bool = Field(False, description="Chats: end with the template's assistant header.")
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class EmbeddingRequest(PoolingInput):
    """OpenAI's embeddings request, with vLLM's extensions (``truncate_prompt_tokens``, ``add_special_tokens``,
    ``normalize``, ``priority``, ``cache_salt``, chat ``messages``)."""

    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="Matryoshka models: keep the first N values.")
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="Keep each input's last N tokens (-1: as many as fit)."
    )
    normalize: bool | None = Field(None, description="L2-normalize (default: as the model's recipe says).")
    priority: int | None = None
    cache_salt: str | None = None


class GenerateRequest(_NullIsDefault):
    """SGLang-style native generation over text or token ids, single or batched."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1, description="First prompt position to return logprobs for.")
    top_logprobs_num: int = Field(0, ge=0)
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    routing_text: str | None = Field(
        None, description="Not read here: the text a router in front routes an input_ids request by (no tokenizer)."
    )
    priority: int | None = Field(None, description="With --schedule-policy priority: lower runs first.")
    lora_path: str | list[str | None] | None = Field(
        None, description="The LoRA adapter (its --lora-modules name) to run with; a list: one per prompt (SGLang's)."
    )


class AbortRequest(_Lenient):
    rid: str | None = None
    abort_all: bool = False
