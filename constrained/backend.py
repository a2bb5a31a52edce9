"""The backend interface and the default backend, llguidance.

A backend turns a ``ConstraintSpec`` into a ``CompiledGrammar`` (immutable, shared by every request with the same
spec) whose ``new_matcher()`` gives each request its own ``Matcher`` (the parse state).

Matcher invariants (every backend):
  * ``fill_bitmask`` sets exactly the bits of the tokens that keep the output a prefix of some string of the
    grammar, plus the EOS ids where the grammar may end; never a special or padding id otherwise;
  * ``accept_token`` returns False and leaves the state unchanged for a token that cannot continue the output;
    it accepts every such token the mask allows, and possibly more: where the grammar forces the next bytes,
    llguidance's mask keeps only the token that spells them canonically, while ``accept_token`` takes any
    tokenization of valid bytes (so jump-forward and replayed outputs are never refused);
  * ``is_terminated()``: the grammar is complete and nothing but EOS may follow (the request is done);
    ``can_terminate()``: EOS is allowed now;
  * ``forced_tokens()`` are tokens that every continuation starts with, tokenized canonically, never special;
    they are a suggestion: the caller appends them with ``accept_token`` (or not) and the state only moves then;
  * ``rollback(n)`` undoes the last ``n`` accepted tokens, ``0 <= n <= num_tokens``;
  * ``error()`` is None while the grammar can be followed; once a backend limit is hit or no continuation exists
    it says why, and stays set: the request must then fail (its mask no longer means anything).

Every compiled grammar has been probed: its first masks were computed (on the compile worker, so a slow first
mask never stalls the engine loop), and a grammar that admits no output or blows a backend limit at once is
refused at compile time with ``GrammarError``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from functools import lru_cache, partial
from typing import Any, Protocol

import llguidance
import torch

from radixserve.constrained import json_schema
from radixserve.constrained.reasoning_grammar import answer_spec, reasoning_grammar
from radixserve.constrained.spec import ConstraintSpec, GrammarError, pointer_join, tool_or_answer_parts
from radixserve.constrained.tokenizer import TokenizerInfo
from radixserve.constrained.tool_grammar import tool_or_answer_lark, under

_SPEC_FORMATS = (
    "date-time",
    "time",
    "date",
    "duration",
    "email",
    "idn-email",
    "hostname",
    "idn-hostname",
    "ipv4",
    "ipv6",
    "uri",
    "uri-reference",
    "iri",
    "iri-reference",
    "uuid",
    "uri-template",
    "json-pointer",
    "relative-json-pointer",
    "regex",
)
MAX_GRAMMAR_CHARS = 8 << 20  # a rewritten schema this large is refused before the backend parses it
_RECURSION = re.compile(r"circular references|stack level exceeded|schema too large")
PROBE_STEPS = 4
# Longest forced stretch that jump-forward tokenizes at once (only pathological grammars force more).
MAX_JUMP_BYTES = 64 << 10
# ``screen`` compiles on this fraction of the lexer budget (see there).
SCREEN_BUDGET_DIVISOR = 10
NO_OUTPUT = (
    "it admits no output (e.g. a rule or a $ref that refers only to itself, with no way to end, or a number's "
    "bounds with a fractional multipleOf, which the grammar engine cannot always express)"
)
_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \["([^"]+)"')


class Matcher(Protocol):
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...
    def accept_token(self, token_id: int) -> bool: ...
    def is_terminated(self) -> bool: ...
    def can_terminate(self) -> bool: ...
    def forced_tokens(self) -> list[int]: ...
    def rollback(self, num_tokens: int) -> None: ...
    def error(self) -> str | None: ...
    @property
    def num_tokens(self) -> int: ...


class CompiledGrammar(Protocol):
    key: str

    def new_matcher(self) -> Matcher: ...


class GrammarBackend(Protocol):
    name: str

    def compile(self, spec: ConstraintSpec) -> CompiledGrammar:
        """Blocking compilation; raises ``GrammarError``. Safe to call from several threads at once.

        A backend may also offer ``screen(spec) -> (passed, grammar text)``, a cheap trial the compiler runs under
        a queue, and then takes ``compile(spec, grammar=text)`` (see ``LLGuidanceBackend.screen``)."""
        ...


@lru_cache(maxsize=1)
def llguidance_formats() -> frozenset[str]:
    """The JSON-schema ``format`` values llguidance enforces (the others are annotations, see json_schema.py)."""
    ok = set()
    for fmt in _SPEC_FORMATS:
        grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "string", "format": fmt})
        if llguidance.LLMatcher.validate_grammar(grammar) == "":
            ok.add(fmt)
    return frozenset(ok)


def check_bitmask(bitmask: torch.Tensor, words: int) -> None:
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.device.type != "cpu":
        raise ValueError(f"bitmask must be a 2-D int32 CPU tensor, got {bitmask.dtype} {tuple(bitmask.shape)}")
    if bitmask.shape[1] < words or bitmask.stride(1) != 1:
        raise ValueError(f"bitmask rows must be contiguous with at least {words} int32 words")


class LLGuidanceMatcher:
    """Per-request parse state over one llguidance grammar. Not thread-safe: one request, one thread."""

    def __init__(self, info: TokenizerInfo, matcher: llguidance.LLMatcher) -> None:
        self._info = info
        self._m = matcher
        self._accepted = 0

    @property
    def num_tokens(self) -> int:
        return self._accepted

    @property
    def ll_matcher(self) -> llguidance.LLMatcher:
        return self._m

    @property
    def words(self) -> int:
        """int32 words of this matcher's bitmask row."""
        return self._info.bitmask_words

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = self._info.bitmask_words
        check_bitmask(bitmask, words)
        self._m.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), words * 4)
        if bitmask.shape[1] > words:
            bitmask[row, words:] = 0

    def accept_token(self, token_id: int) -> bool:
        if self._m.is_stopped():
            return token_id in self._info.eos_token_ids  # EOS after completion changes nothing
        if self._m.try_consume_tokens([int(token_id)]) != 1:
            return False
        self._accepted += 1
        return True

    def is_terminated(self) -> bool:
        return self._m.is_stopped() and not self._m.is_error()

    def can_terminate(self) -> bool:
        return self._m.is_accepting()

    def forced_tokens(self) -> list[int]:
        if self._m.is_stopped() or len(self._m.compute_ff_bytes()) > MAX_JUMP_BYTES:
            return []  # tokenizing a giant forced stretch holds the GIL; the mask still forces it token by token
        out = []
        for tok in self._m.compute_ff_tokens():
            if tok in self._info.special_ids:
                break  # e.g. "<|im_end|>" as forced text: the model spells it with text tokens
            out.append(tok)
        return out

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens; {self._accepted} were accepted")
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"llguidance rollback failed: {self._m.get_error()}")
        self._accepted -= num_tokens

    def error(self) -> str | None:
        return _explain(self._m.get_error()) if self._m.is_error() else None


class LLGuidanceGrammar:
    """A compiled llguidance grammar: a pristine matcher that every request's matcher is copied from."""

    def __init__(self, key: str, info: TokenizerInfo, template: llguidance.LLMatcher) -> None:
        self.key = key
        self._info = info
        self._template = template

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._info, self._template.deep_copy())


class LLGuidanceBackend:
    """llguidance: lazy lexer + Earley parser, ~30 us per mask, errors instead of ignoring keywords.

    ``json_max_whitespace``: 0 (default) is compact JSON (``,`` and ``:`` without spaces, as
    ``json.dumps(separators=(",", ":"))``); N > 0 allows up to N whitespace characters between tokens, so no
    model can loop on whitespace either way. ``limits`` bound the work of one compilation and one mask.
    """

    name = "llguidance"

    def __init__(
        self,
        info: TokenizerInfo,
        *,
        json_max_whitespace: int = 0,
        limits: llguidance.LLParserLimits | None = None,
    ) -> None:
        if json_max_whitespace < 0:
            raise ValueError("json_max_whitespace must be >= 0")
        self.info = info
        self.limits = limits or llguidance.LLParserLimits(verbose_errors=False)
        self.screen_limits = _scaled(self.limits, SCREEN_BUDGET_DIVISOR)
        self.json_options: dict[str, Any] = {
            "item_separator": ",",
            "key_separator": ":",
            "whitespace_flexible": json_max_whitespace > 0,
            "coerce_one_of": False,
            "lenient": False,
        }
        if json_max_whitespace:
            self.json_options["whitespace_pattern"] = rf"[\x20\x0A\x0D\x09]{{0,{json_max_whitespace}}}"

    def grammar_text(self, spec: ConstraintSpec, *, reshape: bool = False) -> str:
        """The llguidance grammar for ``spec`` (JSON schemas rewritten first); raises ``GrammarError``."""
        spec.validate()
        if spec.kind == "json_schema":
            prepared = json_schema.rewrite_schema(spec.value, llguidance_formats(), reshape=reshape)
            if isinstance(prepared, bool):  # llguidance applies its options to an object schema only
                if not prepared:
                    raise GrammarError.invalid_schema("", "the schema is false, so no output could satisfy it")
                prepared = {}
            try:
                grammar = llguidance.LLMatcher.grammar_from_json_schema(prepared, overrides=self.json_options)
            except ValueError as exc:  # e.g. "Value is not JSON serializable" for a bound past 2**64
                raise _error(spec, str(exc)) from None
            if len(grammar) > MAX_GRAMMAR_CHARS:
                raise GrammarError(f"the schema expands to {len(grammar)} characters", kind="too_complex")
            return grammar
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=self.json_options)
        if spec.kind == "tool_or_answer":
            rewrite = partial(json_schema.rewrite_schema, known_formats=llguidance_formats(), reshape=reshape)
            lark = tool_or_answer_lark(spec.value, rewrite, self.json_options)
            if len(lark) > MAX_GRAMMAR_CHARS:
                raise GrammarError(f"the schemas expand to {len(lark)} characters", kind="too_complex")
            try:
                return llguidance.LLMatcher.grammar_from_lark(lark)
            except ValueError as exc:
                raise self._blame(spec, self.limits) or _error(spec, str(exc)) from None
        if spec.kind == "reasoning":
            inner = spec.value["inner"]
            answer = self.grammar_text(inner, reshape=reshape) if inner is not None else None
            close_is_one_token = len(self.info.ll_tokenizer.tokenize_str(spec.value["close"])) == 1
            return reasoning_grammar(spec.value, answer, close_is_one_token)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            # One lexeme, not one rule per choice: the lexer's automaton handles tens of thousands of options,
            # while an Earley row with one item per choice is capped at ``max_items_in_row``.
            lark = "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.value)
            return llguidance.LLMatcher.grammar_from_lark(lark)
        try:
            return llguidance.grammar_from("grammar", spec.value)
        except ValueError as exc:
            raise GrammarError(f"invalid grammar: {clean_message(str(exc))}") from None

    def compile(self, spec: ConstraintSpec, grammar: str = "") -> LLGuidanceGrammar:
        """``grammar``: the text ``screen`` returned for ``spec`` (saves building it again), else built here."""
        return self._compile(spec, self.limits, grammar)

    def screen(self, spec: ConstraintSpec) -> tuple[bool, str]:
        r"""Whether ``spec`` compiles on a tenth of the lexer budget (the matcher is dropped), and its grammar text
        for ``compile``.

        Raises ``GrammarError`` for what no budget changes (the schema rewrite, the regex or grammar syntax);
        False means only the small budget failed, for a compile on the full one to decide. Every JSONSchemaBench
        schema that compiles at all passes, while pathological grammars (``\p{L}(b{600}){600}``) fail here in a
        few ms instead of ~120 ms: the compiler uses it to keep those off its fast lane.
        """
        grammar = self.grammar_text(spec)
        problem = llguidance.LLMatcher.validate_grammar(grammar)  # no lexer built: ~1 ms
        if problem:
            error = _error(answer_spec(spec), problem)
            # A union's error is traced to its failing part by the full compile (``_blame``), as without a queue.
            final = error.kind in ("invalid", "unsupported") and not _RECURSION.search(problem)
            if final and answer_spec(spec).kind != "tool_or_answer":
                raise error
            return False, grammar  # a size or recursion problem: the full compile (and its reshaping) decides
        try:
            self._compile(spec, self.screen_limits, grammar)
        except GrammarError:
            return False, grammar
        return True, grammar

    def _compile(self, spec: ConstraintSpec, limits: llguidance.LLParserLimits, grammar: str = "") -> LLGuidanceGrammar:
        matcher = self._matcher(grammar or self.grammar_text(spec), limits)
        schemas = ("json_schema", "tool_or_answer")
        base = answer_spec(spec)  # what a think section wraps decides how failures are read
        if matcher.is_error() and base.kind in schemas and _RECURSION.search(matcher.get_error()):
            # llguidance could not intersect through a recursive definition: retry with references reshaped.
            matcher = self._matcher(self.grammar_text(spec, reshape=True), limits)
        if matcher.is_error():
            blame = self._blame(base, limits) if base.kind == "tool_or_answer" else None
            raise blame or _error(base, matcher.get_error())
        problem = self._probe(matcher)
        if problem is not None:
            raise problem
        return LLGuidanceGrammar(spec.key, self.info, matcher)

    def _blame(self, spec: ConstraintSpec, limits: llguidance.LLParserLimits) -> GrammarError | None:
        """For a ``tool_or_answer`` that llguidance refused as a whole: the error of the part that fails on its own,
        at that part's pointer (so it reaches the client at ``tools[i]...`` or ``response_format``, without the
        lines of a grammar the client never wrote); None when each part compiles alone."""
        for prefix, schema in tool_or_answer_parts(spec.value):
            try:
                self._compile(ConstraintSpec("json_schema", schema), limits)
            except GrammarError as exc:
                return under(exc, prefix)
        return None

    def _probe(self, template: llguidance.LLMatcher) -> GrammarError | None:
        """Follow a copy of ``template`` for up to ``PROBE_STEPS`` tokens (the forced ones, else the smallest
        allowed id); why the grammar cannot be served, or None.

        This catches grammars with no finite output (``start: start``, a ``$ref`` to itself) and grammars whose
        lexer blows its limits on the first tokens (``(a{1000}){1000}``). The lexer's state is shared by every copy
        of the template, so the expensive first masks are computed here, on the compile worker, once.
        """
        probe = LLGuidanceMatcher(self.info, template.deep_copy())
        row = torch.zeros((1, self.info.bitmask_words), dtype=torch.int32)
        for _ in range(PROBE_STEPS):
            probe.fill_bitmask(row, 0)
            why = probe.error()
            if why is not None:
                kind = "too_complex" if "limit" in why or "too many" in why else "invalid"
                return GrammarError(f"the constraint cannot be enforced: {clean_message(why)}", kind=kind)
            if probe.is_terminated():
                return None
            allowed = _first_allowed(row[0], exclude=self.info.eos_token_ids)
            if allowed is None:
                if probe.can_terminate():
                    return None  # only the end is allowed, e.g. the empty-string grammar
                return GrammarError(f"the constraint cannot be enforced: {NO_OUTPUT}", kind="invalid")
            forced = probe.forced_tokens()
            for token in forced or [allowed]:
                if not probe.accept_token(token):
                    why = probe.error() or f"token {token} allowed by the mask was refused"
                    why = clean_message(why)
                    return GrammarError(f"the constraint cannot be enforced: {why}", kind="too_complex")
        return None

    def _matcher(self, grammar: str, limits: llguidance.LLParserLimits) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(self.info.ll_tokenizer, grammar, log_level=0, limits=limits)


def _scaled(limits: llguidance.LLParserLimits, divisor: int) -> llguidance.LLParserLimits:
    """``limits`` with the lexer's fuel and state budget divided by ``divisor``."""
    return llguidance.LLParserLimits(
        max_items_in_row=limits.max_items_in_row,
        initial_lexer_fuel=max(1, limits.initial_lexer_fuel // divisor),
        step_lexer_fuel=max(1, limits.step_lexer_fuel // divisor),
        step_max_items=limits.step_max_items,
        max_lexer_states=max(1, limits.max_lexer_states // divisor),
        max_grammar_size=limits.max_grammar_size,
        precompute_large_lexemes=limits.precompute_large_lexemes,
        verbose_errors=limits.verbose_errors,
    )


def _first_allowed(row: torch.Tensor, exclude: Sequence[int]) -> int | None:
    """The smallest token id whose bit is set in one bitmask row, other than ``exclude``."""
    words = row.nonzero().flatten().tolist()
    for word in words:
        bits = int(row[word]) & 0xFFFFFFFF
        for bit in range(32):
            token = word * 32 + bit
            if bits >> bit & 1 and token not in exclude:
                return token
    return None


# Where llguidance's messages go on with what only its developers need: a Rust backtrace after a panic, the names
# of every special token (renamed in our copy of the tokenizer).
_DEVELOPER_DETAIL = ("\n<backtrace>", "\nstack backtrace:", "; following special tokens are available")
MAX_MESSAGE_CHARS = 1000


def clean_message(message: str) -> str:
    """An llguidance error message fit for an API client: developer detail cut, at most ``MAX_MESSAGE_CHARS``."""
    for marker in _DEVELOPER_DETAIL:
        cut = message.find(marker)
        if cut >= 0:
            message = message[:cut]
    return message if len(message) <= MAX_MESSAGE_CHARS else message[:MAX_MESSAGE_CHARS] + "..."


def _explain(message: str) -> str:
    """llguidance's terse error, with what it means for a user."""
    message = clean_message(message.replace("<non-verbose/>", "").strip())
    if "NoExtensionBias" in message or not message:
        return NO_OUTPUT
    if "too many expressions" in message or "fuel" in message or "limit" in message:
        return f"{message} (a backend limit was hit: the pattern is too large, e.g. nested counted repetitions)"
    return message


def _error(spec: ConstraintSpec, message: str) -> GrammarError:
    """A ``GrammarError`` for an llguidance failure, with the JSON pointer when it can be found."""
    message = clean_message(message.strip())
    if spec.kind == "regex":
        return GrammarError(f"invalid regex: {message}")
    if spec.kind == "grammar":
        return GrammarError(f"invalid grammar: {message}")
    if spec.kind not in ("json_schema", "tool_or_answer"):
        return GrammarError(message, kind="internal")
    if "regex parse error" in message or "invalid regex" in message:
        parts = [("", spec.value)] if spec.kind == "json_schema" else tool_or_answer_parts(spec.value)
        for prefix, schema in parts:
            found = _bad_pattern(schema, prefix)
            if found:
                why = f"pattern {found[1]!r} is not supported: {message}"
                return GrammarError.invalid_schema(found[0], why, "pattern")
    m = _UNIMPLEMENTED.search(message)
    if m:
        return GrammarError.unsupported(m.group(1), "", message)
    too_big = ("too large", "stack level", "circular references", "Failed to generate", "too complex")
    too_big += ("not JSON serializable",)  # a number past 64 bits
    kind = "too_complex" if any(s in message for s in too_big) else "invalid"
    return GrammarError(f"JSON schema cannot be compiled: {message}", kind=kind)


def _bad_pattern(schema: Any, prefix: str = "") -> tuple[str, str] | None:
    """(pointer, pattern) of the first ``pattern`` / ``patternProperties`` regex llguidance rejects."""
    stack: list[tuple[str, Any]] = [(prefix, schema)]
    while stack:
        ptr, node = stack.pop()
        if isinstance(node, dict):
            found = []
            if isinstance(node.get("pattern"), str):
                found.append((pointer_join(ptr, "pattern"), node["pattern"]))
            if isinstance(node.get("patternProperties"), dict):
                found += [(pointer_join(ptr, "patternProperties", p), p) for p in node["patternProperties"]]
            for where, pattern in found:
                probe = llguidance.LLMatcher.grammar_from_json_schema({"type": "string", "pattern": pattern})
                if llguidance.LLMatcher.validate_grammar(probe):
                    return where, pattern
            stack.extend((pointer_join(ptr, k), v) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((pointer_join(ptr, i), v) for i, v in enumerate(node))
    return None
