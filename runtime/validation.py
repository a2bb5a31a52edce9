"""The checks a request must pass before it is queued, shared by the in-process engine and the front end of an
engine process (which refuses at once, without a round trip)."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from radixserve.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.runtime.pooling import PoolingModel


def validate_request(
    prompt_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_context_len: int,
    kv_slots: int,
    schedule_policy: str = "lpm",
    lora_names: Collection[str] = (),
    pooling: PoolingModel | None = None,
) -> None:
    """Raise ``ValueError`` (a message fit for an API client) if the request can never be served. ``lora_names``:
    the adapters served (``--lora-modules``); ``pooling``: the embeddings served (``--runner pooling``), whose
    engine serves nothing else."""
    params.validate(vocab_size)
    if pooling is None and params.pooling is not None:
        raise ValueError("this server generates text: embeddings need a server started with --runner pooling")
    if pooling is not None:
        if params.pooling is None:
            what = "embeddings" if pooling.labels is None else "scores (a classifier)"
            raise ValueError(f"this server serves {what} (--runner pooling): it generates no text")
        pooling.check(params.pooling)
    if params.lora_name is not None and params.lora_name not in lora_names:
        served = f"it serves {', '.join(sorted(lora_names))}" if lora_names else "it serves no adapter now"
        raise ValueError(f"no LoRA adapter is named {params.lora_name!r} on this server; {served}")
    if params.priority != 0 and schedule_policy != "priority":
        # As vLLM: a priority that nothing reads would be a promise the server does not keep.
        raise ValueError("priority needs a server started with --schedule-policy priority; leave it out (or 0)")
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"prompt token id {bad} is out of range [0, {vocab_size})")
    if len(prompt_ids) >= max_context_len + (params.pooling is not None):  # (an embedding generates nothing)
        raise ValueError(
            f"the prompt has {len(prompt_ids)} tokens but the context length is {max_context_len}; shorten the prompt"
        )
    need = min(len(prompt_ids) + params.max_new_tokens, max_context_len)
    if need > kv_slots:
        raise ValueError(
            f"this request needs up to {need} tokens of KV cache (prompt {len(prompt_ids)} + max_new_tokens "
            f"{params.max_new_tokens}) but the pool holds {kv_slots}; lower max_tokens or start the server with a "
            "larger --max-total-tokens"
        )
