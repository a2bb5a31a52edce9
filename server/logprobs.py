"""Log-probabilities in the three shapes clients expect: OpenAI chat, OpenAI (legacy) completions, SGLang."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from radixserve.runtime.request import TokenLogprob
from radixserve.server.tokens import TokenNames

Names = Callable[[int], str]


def _chat_entry(token_id: int, logprob: float, names: TokenNames) -> dict[str, Any]:
    return {"token": names(token_id), "logprob": logprob, "bytes": names.bytes_of(token_id)}


def chat_logprobs(lps: Sequence[TokenLogprob], names: TokenNames, top_n: int | None = None) -> dict[str, Any]:
    """``choice.logprobs`` of a chat completion (or of one streamed chunk); ``top_n`` alternatives at most."""
    content = []
    for lp in lps:
        entry = _chat_entry(lp.token_id, lp.logprob, names)
        entry["top_logprobs"] = [_chat_entry(t, v, names) for t, v in lp.top[:top_n]]
        content.append(entry)
    return {"content": content, "refusal": None}


def prompt_entries(prompt_ids: Sequence[int], prompt_lps: Sequence[TokenLogprob] | None) -> list[TokenLogprob | None]:
    """One entry per prompt token: ``None`` for the first (nothing predicts it), then the engine's."""
    lps = list(prompt_lps or [])[: max(0, len(prompt_ids) - 1)]
    entries: list[TokenLogprob | None] = [None] * (len(prompt_ids) - len(lps))
    entries.extend(lps)
    return entries


def vllm_prompt_logprobs(
    prompt_lps: Sequence[TokenLogprob] | None, names: Names, top_n: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: ``None`` for the first prompt token (nothing predicts it), then for each token a
    map from token id (as text) to ``{logprob, rank, decoded_token}``: the prompt's own token first, then the
    ``top_n`` best ranked 1..n (as in vLLM, an own token among them takes its place in that order)."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for lp in prompt_lps or ():
        entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": names(lp.token_id)}}
        for rank, (t, v) in enumerate(lp.top[:top_n], start=1):
            entry[str(t)] = {"logprob": v, "rank": rank, "decoded_token": names(t)}
        out.append(entry)
    return out


def completion_logprobs(
    token_ids: Sequence[int],
    lps: Sequence[TokenLogprob | None],
    names: Names,
    text_offset: int = 0,
    shown: Names | None = None,
    top_n: int | None = None,
) -> dict[str, Any]:
    """``choice.logprobs`` of a legacy completion: parallel lists, offsets index into the choice's text.

    ``top_logprobs`` maps token text to logprob and includes the chosen token, as OpenAI's does. ``shown`` names
    the tokens in the lists when it is not their text (``"token_id:<id>"``); offsets still count the text.
    """
    shown = shown or names
    tokens, token_lps, tops, offsets = [], [], [], []
    for token_id, lp in zip(token_ids, lps):
        text = shown(token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(names(token_id))
        if lp is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(lp.logprob)
        top = {shown(t): v for t, v in lp.top[:top_n]}
        top.setdefault(text, lp.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def native_logprobs(
    token_ids: Sequence[int], lps: Sequence[TokenLogprob | None], names: Names | None
) -> tuple[list[list[Any]], list[list[list[Any]] | None]]:
    """SGLang's ``(logprob, token_id, text or None)`` triples, and the top alternatives per position."""
    chosen, tops = [], []
    for token_id, lp in zip(token_ids, lps):
        text = names(token_id) if names else None
        if lp is None:
            chosen.append([None, token_id, text])
            tops.append(None)
            continue
        chosen.append([lp.logprob, token_id, text])
        tops.append([[v, t, names(t) if names else None] for t, v in lp.top])
    return chosen, tops
