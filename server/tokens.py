"""Tokenizer helpers the routes share: encoding prompts and naming tokens for logprobs."""

from __future__ import annotations

import threading
from typing import Any

from radixserve.server.errors import bad_request


def encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    """Token ids of ``text``.

    Goes straight to the Rust tokenizer when there is one: the Python wrapper's ``encode`` may reconfigure
    truncation/padding on the shared backend, which races with the engine thread decoding on the same object.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return list(backend.encode(text, add_special_tokens=add_special_tokens).ids)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def prompt_items(raw: Any, param: str) -> list[Any]:
    """OpenAI's prompt shapes (a text, texts, token ids, lists of token ids) as a list of texts and id lists; a
    400 naming ``param`` for an empty list."""
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif raw and isinstance(raw[0], int):
        items = [raw]
    else:
        items = list(raw)
    if not items:
        raise bad_request(f"{param} must not be an empty list", param)
    return items


def item_ids(item: Any, k: int, tokenizer: Any, vocab_size: int, add_special_tokens: bool, param: str) -> list[int]:
    """The token ids of prompt ``k`` (``prompt_items``), checked before anything decodes them: a 400 naming
    ``param`` for an id outside the vocabulary or an empty prompt."""
    if isinstance(item, str):
        ids = encode(tokenizer, item, add_special_tokens=add_special_tokens)
    else:
        ids = list(item)
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(f"{param} {k}: token id {bad} is out of range [0, {vocab_size})", param)
    if not ids:
        raise bad_request(f"{param} {k} is empty: give at least one token", param)
    return ids


class TokenNames:
    """``token_id -> text`` as a client sees it in logprobs (decoded, so "Ġhello" reads " hello"), and the
    token's own bytes (``bytes_of``), which OpenAI's ``bytes`` field carries so that a client can join the pieces of
    a character split over several tokens (each of which decodes to U+FFFD alone). Memoized: vocabularies are
    small."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._bytes: list[bytes | None] | None = None
        self._lock = threading.Lock()

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text

    def bytes_of(self, token_id: int) -> list[int]:
        """The token's bytes in the vocabulary (byte-level BPE or SentencePiece with byte fallback); its decoded
        text's UTF-8 where the vocabulary has another encoding."""
        if self._bytes is None:
            with self._lock:
                if self._bytes is None:
                    self._bytes = _vocabulary_bytes(self.tokenizer)
        raw = self._bytes[token_id] if token_id < len(self._bytes) else None
        return list(raw if raw is not None else self(token_id).encode("utf-8"))


def _vocabulary_bytes(tokenizer: Any) -> list[bytes | None]:
    from radixserve.constrained.tokenizer import TokenizerError, raw_token_bytes

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return []
    try:
        return raw_token_bytes(backend)[0]
    except TokenizerError:
        return []


class TokenIdNames:
    """``TokenNames``' interface naming each token ``"token_id:<id>"`` (vLLM's ``return_tokens_as_token_ids``): a
    client that must know the exact tokens (several can decode to the same text) reads them from logprobs. As in
    vLLM, ``bytes`` are those of that name."""

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}"

    def bytes_of(self, token_id: int) -> list[int]:
        return list(self(token_id).encode())
