"""Other grammar backends, for measurement (bench/jsonschemabench.py) only: never the serving default.

Both accept JSON schemas they do not fully enforce: xgrammar ignores keywords such as ``allOf``, ``not``, ``if``
and ``uniqueItems`` without an error, outlines-core ignores numeric bounds and builds its index eagerly (seconds
to minutes, hundreds of MB on real schemas). Measuring them on the same instances shows what that costs. They
implement the same ``Matcher`` protocol as the default backend, on the same byte-exact vocabulary; the imports
are done on construction so the serving path never loads them.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from radixserve.constrained.backend import check_bitmask
from radixserve.constrained.spec import ConstraintSpec, GrammarError
from radixserve.constrained.tokenizer import TokenizerInfo


def _serving_only(spec: ConstraintSpec, backend: str) -> None:
    if spec.kind in ("tool_or_answer", "reasoning"):  # chat-serving constraints; these backends are for measurement
        raise GrammarError(f"{backend} does not build {spec.kind} grammars; use llguidance", kind="unsupported")


class XGrammarMatcher:
    def __init__(self, info: TokenizerInfo, matcher: Any) -> None:
        self._info = info
        self._m = matcher
        self._accepted = 0

    @property
    def num_tokens(self) -> int:
        return self._accepted

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        check_bitmask(bitmask, self._info.bitmask_words)
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        if self._m.is_terminated():
            return token_id in self._info.eos_token_ids
        if token_id in self._info.special_ids and token_id not in self._info.eos_token_ids:
            return False
        ok = bool(self._m.accept_token(int(token_id)))
        self._accepted += ok
        return ok

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def can_terminate(self) -> bool:
        return bool(self._m.is_completed())

    def forced_tokens(self) -> list[int]:
        forced = self._m.find_jump_forward_string()
        ids = self._info.ll_tokenizer.tokenize_str(forced) if forced else []
        return ids[:-1]  # the last token may merge with what follows; leave it to the model

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens; {self._accepted} were accepted")
        self._m.rollback(num_tokens)
        self._accepted -= num_tokens

    def error(self) -> str | None:
        return None  # xgrammar has no error state: a refused token is reported by accept_token alone


class XGrammarGrammar:
    def __init__(self, key: str, info: TokenizerInfo, compiled: Any) -> None:
        self.key = key
        self._info = info
        self._compiled = compiled

    def new_matcher(self) -> XGrammarMatcher:
        import xgrammar

        return XGrammarMatcher(self._info, xgrammar.GrammarMatcher(self._compiled, max_rollback_tokens=-1))


class XGrammarBackend:
    """xgrammar with compact separators and ``strict_mode=False`` (JSON Schema's own defaults)."""

    name = "xgrammar"

    def __init__(self, info: TokenizerInfo) -> None:
        import xgrammar

        self.info = info
        vocab = list(info.token_bytes)
        tok = xgrammar.TokenizerInfo(vocab, vocab_size=info.vocab_size, stop_token_ids=list(info.eos_token_ids))
        self._compiler = xgrammar.GrammarCompiler(tok, max_threads=1, cache_enabled=False)

    def compile(self, spec: ConstraintSpec) -> XGrammarGrammar:
        spec.validate()
        _serving_only(spec, "xgrammar")
        try:
            if spec.kind in ("json_schema", "json_object"):
                schema = spec.value if spec.kind == "json_schema" else {"type": "object"}
                compiled = self._compiler.compile_json_schema(
                    json.dumps(schema), any_whitespace=False, separators=(",", ":"), strict_mode=False
                )
            elif spec.kind == "regex":
                compiled = self._compiler.compile_regex(spec.value)
            elif spec.kind == "choice":
                compiled = self._compiler.compile_regex("|".join(re.escape(c) for c in spec.value))
            else:
                compiled = self._compiler.compile_grammar(spec.value)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError subclasses with its message
            raise GrammarError(f"xgrammar: {exc}") from None
        return XGrammarGrammar(spec.key, self.info, compiled)


class OutlinesCoreMatcher:
    """outlines-core guide; it has no jump-forward (``forced_tokens`` is always empty)."""

    def __init__(self, info: TokenizerInfo, guide: Any) -> None:
        self._info = info
        self._g = guide
        self._accepted = 0
        self._ended = False

    @property
    def num_tokens(self) -> int:
        return self._accepted

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = self._info.bitmask_words
        check_bitmask(bitmask, words)
        self._g.write_mask_into(bitmask[row].data_ptr(), words, 4)

    def accept_token(self, token_id: int) -> bool:
        if self._ended:
            return token_id in self._info.eos_token_ids
        if token_id in self._info.eos_token_ids:
            self._ended = self._g.is_finished()
            return self._ended
        if token_id not in self._g.get_tokens():
            return False
        self._g.advance(int(token_id), return_tokens=False)
        self._accepted += 1
        return True

    def is_terminated(self) -> bool:
        return self._ended

    def can_terminate(self) -> bool:
        return bool(self._g.is_finished())

    def forced_tokens(self) -> list[int]:
        return []

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens; {self._accepted} were accepted")
        self._g.rollback_state(num_tokens)
        self._accepted -= num_tokens
        self._ended = False

    def error(self) -> str | None:
        return None  # the index is precomputed: no limit can be hit while decoding


class OutlinesCoreGrammar:
    def __init__(self, key: str, info: TokenizerInfo, index: Any) -> None:
        self.key = key
        self._info = info
        self._index = index

    def new_matcher(self) -> OutlinesCoreMatcher:
        import outlines_core

        return OutlinesCoreMatcher(self._info, outlines_core.Guide(self._index, max_rollback=1 << 16))


class OutlinesCoreBackend:
    """outlines-core: JSON schema -> regex -> a precomputed token-level index (compact whitespace)."""

    name = "outlines-core"

    def __init__(self, info: TokenizerInfo) -> None:
        import outlines_core

        self.info = info
        table: dict[bytes, list[int]] = {}
        for tid, data in enumerate(info.token_bytes):
            if data and tid not in info.special_ids:
                table.setdefault(data, []).append(tid)
        self._vocab = outlines_core.Vocabulary(info.eos_token_ids[0], table)

    def compile(self, spec: ConstraintSpec) -> OutlinesCoreGrammar:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        spec.validate()
        _serving_only(spec, "outlines-core")
        try:
            if spec.kind in ("json_schema", "json_object"):
                schema = spec.value if spec.kind == "json_schema" else {"type": "object"}
                regex = build_regex_from_schema(json.dumps(schema), whitespace_pattern="")
            elif spec.kind == "regex":
                regex = spec.value
            elif spec.kind == "choice":
                regex = "|".join(re.escape(c) for c in spec.value)
            else:
                raise GrammarError("outlines-core has no context-free grammars", kind="unsupported")
            index = outlines_core.Index(regex, self._vocab)
        except GrammarError:
            raise
        except Exception as exc:
            raise GrammarError(f"outlines-core: {exc}") from None
        return OutlinesCoreGrammar(spec.key, self.info, index)
