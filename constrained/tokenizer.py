"""The model's vocabulary as grammar backends need it: raw bytes per token id, special ids, EOS ids.

A naive vocabulary (``convert_ids_to_tokens`` strings, or ``decode([id])``) is wrong twice over: byte-level BPE
spells bytes as stand-in characters (``Ġ`` for a space) and half a UTF-8 character decodes to U+FFFD, and special
tokens such as ``<|im_start|>`` would read as ordinary text that a grammar could match inside a JSON string. Here
every id maps to the exact bytes it contributes to the output, and special, unused and padding ids map to
``b""`` and are flagged special, so no grammar text can ever select them (only EOS, where the grammar may end).

Invariants of ``TokenizerInfo``:
  * ``len(token_bytes) == vocab_size``; ``vocab_size`` is the model's (logit) vocabulary, which may exceed the
    tokenizer's: ids past the tokenizer are padding, special, never allowed;
  * ``special_ids`` holds every added special token, every id the tokenizer does not define and the padding ids;
  * ``eos_token_ids`` is non-empty and a subset of ``special_ids``;
  * ``ll_tokenizer`` encodes text without turning ``<|im_end|>`` written as text into the special token, so the
    tokens it proposes for forced text (jump-forward) are ordinary text tokens.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import llguidance

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
# Texts whose encoding must round-trip through the raw-byte table (catches added prefix spaces and the like).
# Spelled special tokens, code and prose: llguidance's Rust tokenizer must encode these exactly as ours does.
_NATIVE_PROBES = (
    "<|im_end|> <|im_start|>user\n</s><s>[INST]<|endoftext|><|eot_id|>",
    "def f(x):\n    return {'a': [1, 2.5e-3, None]}  # ok\n\n",
    "  The  quick\tbrown fox -- 'jumps' \"over\" 1,234.56 dogs!?\r\n",
    "日本語のテキスト, émoji 🙂 and ∑ symbols",
)
LONG_TEXT = 2048  # characters; see _Source.__call__
_ROUND_TRIP_PROBES = ("a", " a", '{"key":[1,2.5,"x y"]}', "héllo wörld ✓", "\n\t x")

_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple[int, tuple[int, ...]], TokenizerInfo]] = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.Lock()


class TokenizerError(ValueError):
    """The tokenizer cannot be turned into a byte-exact vocabulary."""


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode``: the stand-in character of each byte, back to the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _decoder_types(decoder: dict[str, Any] | None) -> set[str]:
    if not decoder:
        return set()
    if decoder.get("type") == "Sequence":
        return {t for d in decoder.get("decoders", []) for t in _decoder_types(d)}
    kinds = {str(decoder.get("type"))}
    if decoder.get("type") == "Replace" and decoder.get("content") == " ":
        kinds.add("ReplaceSpace")
    return kinds


def raw_token_bytes(backend: Any) -> tuple[list[bytes | None], set[int]]:
    """Bytes of each id of a ``tokenizers.Tokenizer`` (None for ids it does not define) and its special ids."""
    spec = json.loads(backend.to_str())
    kinds = _decoder_types(spec.get("decoder"))
    added = backend.get_added_tokens_decoder()
    vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
    size = max(vocab.values(), default=-1) + 1
    out: list[bytes | None] = [None] * size
    if "ByteLevel" in kinds:
        table = _byte_level_decoder()
        try:
            for text, tid in vocab.items():
                if tid not in added:
                    out[tid] = bytes(table[c] for c in text)
        except KeyError as exc:
            raise TokenizerError(f"byte-level token has a character outside the byte alphabet: {exc}") from None
    elif kinds & {"Metaspace", "ReplaceSpace", "ByteFallback"}:
        for text, tid in vocab.items():
            if tid in added:
                continue
            m = _BYTE_FALLBACK.match(text)
            out[tid] = bytes([int(m.group(1), 16)]) if m else text.replace("\u2581", " ").encode("utf-8")
    else:
        raise TokenizerError(
            f"unsupported tokenizer decoder {sorted(kinds) or 'none'}: expected byte-level BPE (ByteLevel) or "
            "SentencePiece-style (Metaspace / ByteFallback)"
        )
    special = set()
    for tid, tok in added.items():
        out[tid] = tok.content.encode("utf-8")
        if tok.special:
            special.add(tid)
    return out, special


@dataclass(frozen=True, eq=False)
class TokenizerInfo:
    """Byte-exact vocabulary of one model, shared by every grammar compiled for it. Build with ``from_hf``."""

    token_bytes: tuple[bytes, ...]
    special_ids: frozenset[int]
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    ll_tokenizer: llguidance.LLTokenizer

    @property
    def bitmask_words(self) -> int:
        """int32 words per bitmask row: ``ceil(vocab_size / 32)``."""
        return (self.vocab_size + 31) // 32

    @classmethod
    def from_hf(
        cls, tokenizer: Any, *, vocab_size: int | None = None, eos_token_ids: Sequence[int] | None = None
    ) -> TokenizerInfo:
        """Build (once per tokenizer object and arguments, then cached) from a fast HF tokenizer.

        ``vocab_size``: the model's logit width (config ``vocab_size``), default the tokenizer's size.
        ``eos_token_ids``: every id that ends generation (generation config), default the tokenizer's EOS.
        Raises ``TokenizerError`` (a ValueError) for slow tokenizers or unknown vocabulary encodings.
        """
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TokenizerError("a fast (Rust `tokenizers`) tokenizer is required for constrained decoding")
        eos = tuple(sorted({int(t) for t in (eos_token_ids or [tokenizer.eos_token_id]) if t is not None}))
        if not eos:
            raise TokenizerError("the tokenizer has no EOS token; pass eos_token_ids")
        key = (int(vocab_size or 0), eos)
        with _CACHE_LOCK:
            hit = _CACHE.get(tokenizer, {}).get(key)
        if hit is not None:
            return hit
        info = _build(tokenizer, backend, vocab_size, eos)
        with _CACHE_LOCK:
            _CACHE.setdefault(tokenizer, {})[key] = info
        return info


def _disagreement(ll: llguidance.LLTokenizer, size: int, special: set[int], tokens: tuple[bytes, ...]) -> int | None:
    """The first id whose special-ness or bytes differ between ``ll`` and the byte table, or None."""
    for i in range(size):
        if (i in special) != ll.is_special_token(i) or (i not in special and ll.decode_bytes([i]) != tokens[i]):
            return i
    return None


def _native(
    backend: Any, size: int, eos: tuple[int, ...], special: set[int], tokens: tuple[bytes, ...], source: Any
) -> llguidance.LLTokenizer | None:
    """llguidance's own (Rust) copy of the tokenizer, or None when it would not agree with ``source``.

    Why: with a Python tokenizer callback, every mask that has forced bytes (JSON keys, enum tails) calls back into
    Python holding the GIL, so grammar work on the compile workers and the batched masks stall the engine loop.
    In the copy, special added tokens are renamed to names no text contains, so text that spells ``<|im_end|>``
    tokenizes as text (what ``encode_special_tokens=True`` does, a flag the JSON form cannot carry). The copy is
    used only if it agrees with ``source`` on every id's bytes, on special-ness and on sample encodings.
    """
    spec = json.loads(backend.to_str())
    vocab = spec.get("model", {}).get("vocab")
    for added in spec.get("added_tokens", []):
        if added.get("special"):
            renamed = f"<radixserve-special-{added['id']}-\u2063>"
            if isinstance(vocab, dict) and vocab.get(added["content"]) == added["id"]:
                del vocab[added["content"]]
                vocab[renamed] = added["id"]
            added["content"] = renamed
    try:
        ll = llguidance.LLTokenizer(json.dumps(spec), n_vocab=size, eos_token=list(eos))
    except (ValueError, RuntimeError):
        return None
    if _disagreement(ll, size, special, tokens) is not None:
        return None
    probes = _ROUND_TRIP_PROBES + _NATIVE_PROBES
    if any(ll.tokenize_str(p) != source(p) for p in probes):
        return None
    return ll


def _build(tokenizer: Any, backend: Any, vocab_size: int | None, eos: tuple[int, ...]) -> TokenizerInfo:
    raw, special = raw_token_bytes(backend)
    size = int(vocab_size or len(raw))
    if size < len(raw):
        raise TokenizerError(f"vocab_size {size} is smaller than the tokenizer's {len(raw)} ids")
    special |= {int(t) for t in getattr(tokenizer, "all_special_ids", ())}
    special |= set(eos)
    special |= {i for i in range(size) if i >= len(raw) or raw[i] is None}
    if max(eos) >= size:
        raise TokenizerError(f"EOS id {max(eos)} is outside the vocabulary of {size}")
    tokens = tuple(b"" if i in special else raw[i] or b"" for i in range(size))

    encoder = copy.copy(backend)
    encoder.no_padding()
    encoder.no_truncation()
    encoder.encode_special_tokens = True  # "<|im_end|>" in forced text stays text, never the special token

    class _Source:
        eos_token_id = eos[0]
        bos_token_id = getattr(tokenizer, "bos_token_id", None)
        special_token_ids = sorted(special)

        def __init__(self) -> None:
            self.tokens = list(tokens)

        def __call__(self, text: bytes | str) -> list[int]:
            if isinstance(text, bytes):
                text = text.decode("utf-8", errors="replace")
            if len(text) > LONG_TEXT:
                # llguidance tokenizes the whole forced stretch on every mask; ``encode_batch`` releases the GIL
                # while it works, so a grammar forcing a long text cannot stall the engine loop.
                return encoder.encode_batch([text], add_special_tokens=False)[0].ids
            return encoder.encode(text, add_special_tokens=False).ids

    source = _Source()
    round_trips = all(b"".join(tokens[t] for t in source(p)) == p.encode("utf-8") for p in _ROUND_TRIP_PROBES)
    if round_trips:
        # Prefer llguidance's own copy (no Python callback in masks); the callback is the fallback.
        ll = _native(backend, size, eos, special, tokens, source) or llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(source), eos_token=list(eos)
        )
    else:
        # The tokenizer rewrites text while encoding (e.g. a SentencePiece prefix space): let llguidance drive
        # the Rust tokenizer itself, which knows those rules, and check it agrees with our byte table.
        from llguidance.hf import from_tokenizer  # imports transformers: only on this path

        hf = getattr(tokenizer, "to_transformers", lambda: tokenizer)()  # the engine process's lean one
        ll = from_tokenizer(hf, n_vocab=size, eos_token=list(eos))
        bad = _disagreement(ll, size, special, tokens)
        if bad is not None:
            raise TokenizerError(f"llguidance's view of token {bad} differs from the tokenizer's bytes")
    if ll.vocab_size != size:
        raise TokenizerError(f"llguidance sees {ll.vocab_size} tokens, expected {size}")
    return TokenizerInfo(tokens, frozenset(special), eos, size, ll)
