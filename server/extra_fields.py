"""Request fields the server does not serve: a 400 when they would change the output, a log line otherwise.

Clients written for other servers send their own fields. Silently ignoring one that changes what is generated
(beam search, banned words, a per-request chat template) hands back the wrong output with a 200; so such a field,
sent with a value other than the one that matches what this server does anyway, is a 400 naming it and saying
what to send instead. Fields known to be harmless (``user``, ``metadata``, ``store``, ...) are dropped quietly;
any other unknown field is logged at warning level the first time its name is seen (and at debug level after
that, so a client that always sends it does not flood the log).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from pydantic import BaseModel

from radixserve.server.errors import APIError

logger = logging.getLogger("radixserve.server")

_CHAT_ONLY = "it is served by /v1/chat/completions and /v1/completions; /generate takes token ids in sampling_params"
# Field -> (values that match what this server does anyway, what to do instead).
CHANGES_OUTPUT: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search is not served; sample n choices instead"),
    "best_of": ((1,), "best_of is not served; sample n choices instead"),
    "length_penalty": ((1, 1.0), "beam search is not served"),
    "early_stopping": ((False,), "beam search is not served"),
    "logits_processors": (([],), "custom logits processors are not served; use a constraint or logit_bias"),
    "prompt_logprobs": ((None,), _CHAT_ONLY),
    # Served by /v1/chat/completions and /v1/completions (fields there, so never extras); elsewhere refused.
    "include_stop_str_in_output": ((False,), _CHAT_ONLY),
    "allowed_token_ids": ((None,), _CHAT_ONLY),
    "bad_words": ((None, []), _CHAT_ONLY),
    "truncate_prompt_tokens": ((None,), _CHAT_ONLY),
    "return_tokens_as_token_ids": ((False,), _CHAT_ONLY),
    "spaces_between_special_tokens": ((True,), "special tokens are decoded as the tokenizer does by default"),
    "add_special_tokens": ((False,), "put the special tokens into the prompt text"),
    "chat_template": ((), "start the server with --chat-template"),
    "documents": ((), "put the documents into the messages"),
    "echo": ((False,), "echo is served by /v1/completions"),
    "functions": ((), "legacy function calling is not served; send tools"),
    "function_call": ((), "legacy function calling is not served; send tool_choice"),
    "guided_whitespace_pattern": ((), "JSON whitespace follows the grammar engine's rules"),
    "guided_json_object": ((False,), 'use response_format {"type": "json_object"}'),
    "structural_tag": ((), "structural tags are not served; use tools with tool_choice, or a json schema"),
    "audio": ((), "audio output is not served"),
    "modalities": ((["text"],), "only text output is served"),
}
# The constraint fields chat and completions take: on the other APIs (Responses, Messages) they are not read,
# and an unconstrained answer under a 200 would pass for a constrained one.
_OTHER_API = (
    "this field is read by /v1/chat/completions and /v1/completions; here send a JSON schema as text.format "
    "(Responses) or output_config.format (Messages)"
)
for _name in ("regex", "json_schema", "ebnf", "grammar", "choices", "guided_json", "guided_regex", "guided_choice",
              "guided_grammar", "structured_outputs"):  # fmt: skip
    CHANGES_OUTPUT[_name] = ((None,), _OTHER_API)
# Sent by common clients, with no effect on what is generated here.
HARMLESS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "prediction",
        "safety_identifier",
        "prompt_cache_key",
        "guided_decoding_backend",
        "kv_transfer_params",
        "vllm_xargs",
        "request_id",
        "reasoning_effort",
        "verbosity",
        "web_search_options",
        "return_hidden_states",
    }
)

_seen_lock = threading.Lock()
_seen: set[str] = set()


def check_extra_fields(body: BaseModel, route: str) -> None:
    """Refuse the request's output-changing fields that this server does not serve; log the other unknown ones."""
    extra = body.model_extra or {}
    for name, value in extra.items():
        rule = CHANGES_OUTPUT.get(name)
        if rule is not None and value not in rule[0]:
            raise APIError(
                400,
                f"{name} is not supported by this server ({rule[1]}); remove it from the request",
                param=name,
                code="unsupported_parameter",
            )
    unknown = sorted(n for n in extra if n not in HARMLESS and n not in CHANGES_OUTPUT)
    if not unknown:
        return
    with _seen_lock:
        new = [n for n in unknown if n not in _seen]
        _seen.update(new)
    level = logging.WARNING if new else logging.DEBUG
    logger.log(level, "%s: ignoring unknown field(s) %s", route, ", ".join(unknown))
