"""Tokenizer helpers the routes share: encoding prompts and naming tokens for logprobs."""

from __future__ import annotations

from typing import Any


def encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids of ``text``.

    Goes straight to the Rust tokenizer when there is one: the Python wrapper's ``encode`` may reconfigure
    truncation/padding on the shared backend, which races with the engine thread decoding on the same object.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return list(backend.encode(text, add_special_tokens=add_special_tokens).ids)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


class TokenNames:
    """``token_id -> text`` as a client sees it in logprobs (decoded, so "Ġhello" reads " hello").

    A token that is only part of a UTF-8 character decodes to U+FFFD; its ``bytes`` are then that of the
    replacement character, as in other servers that decode token by token. Memoized: vocabularies are small.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text
