"""Regexes that force very long stretches of text, refused before compiling.

Where a regex leaves only one way to go on (``x{n}``, a literal), a grammar backend computes the whole forced
stretch: llguidance spends ~1.5 ms per 1,000 forced characters of lexer and tokenizer work, and nested counts
multiply (``(b{600}){600}`` forces 360,000 characters: ~1 s per compile, or a stall while decoding once the
stretch is reached). Optional and branching repetitions are cheap however large (``[ab]{300000}``,
``(a{600}){0,600}``: ~1 ms). So the measure is the longest forced run, computed on Python's parse of the pattern
in microseconds; a constraint over ``MAX_FORCED_CHARS`` is refused when submitted (``ConstraintSpec.validate``),
before it costs a compile worker any time. The count errs low, never high: a refused regex really forces that
much. Patterns Python cannot parse, or may read differently from the backend (nested character classes), are left
to the backend and its own limits.
"""

from __future__ import annotations

from typing import Any, NamedTuple

try:  # Python 3.11+
    import re._constants as _c
    import re._parser as _parser
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _parser  # type: ignore[no-redef]

# ~50 ms of compile work; real schemas stay far below (JSONSchemaBench's longest forced run is 27 characters).
MAX_FORCED_CHARS = 32_768

_REPEATS = {_c.MAX_REPEAT, _c.MIN_REPEAT, *((_c.POSSESSIVE_REPEAT,) if hasattr(_c, "POSSESSIVE_REPEAT") else ())}
_ZERO_WIDTH = {_c.AT, _c.ASSERT, _c.ASSERT_NOT}


class _Runs(NamedTuple):
    """Forced characters of a (sub)pattern: its length when all of it is forced (else None), the forced run it
    starts with and ends with (they join its neighbours' runs), and the longest run anywhere in it."""

    fixed: int | None
    prefix: int
    suffix: int
    longest: int


_BREAK = _Runs(None, 0, 0, 0)


def _seq(items: Any, icase: bool) -> _Runs:
    fixed: int | None = 0
    prefix = run = longest = 0
    for op, av in items:
        part = _item(op, av, icase)
        longest = max(longest, part.longest)
        if part.fixed is not None:
            run += part.fixed
            if fixed is not None:
                fixed += part.fixed
                prefix = fixed
        else:
            longest = max(longest, run + part.prefix)
            if fixed is not None:
                prefix = fixed + part.prefix
            fixed = None
            run = part.suffix
        longest = max(longest, run)
    return _Runs(fixed, prefix, run, longest)


def _group_icase(av: Any, icase: bool) -> bool:
    """Whether IGNORECASE holds inside a group ``(?i:...)`` / ``(?-i:...)`` (``av`` of a SUBPATTERN)."""
    _group, add_flags, del_flags, _sub = av
    return (icase or bool(add_flags & _c.SRE_FLAG_IGNORECASE)) and not del_flags & _c.SRE_FLAG_IGNORECASE


def _is_choice(char: int, icase: bool) -> bool:
    """Under IGNORECASE a cased letter is a choice between two characters."""
    return icase and chr(char).lower() != chr(char).upper()


def _item(op: Any, av: Any, icase: bool) -> _Runs:
    if op == _c.LITERAL:
        return _BREAK if _is_choice(av, icase) else _Runs(1, 1, 1, 1)
    if op in _ZERO_WIDTH:
        return _Runs(0, 0, 0, 0)
    if op == _c.SUBPATTERN:
        return _seq(av[-1], _group_icase(av, icase))
    if op == getattr(_c, "ATOMIC_GROUP", None):
        return _seq(av, icase)
    if op in _REPEATS:
        low, high, sub = av
        inner = _seq(sub, icase)
        if low == 0:
            return _Runs(0 if high == 0 else None, 0, 0, inner.longest)
        if inner.fixed is not None:
            forced = low * inner.fixed
            return _Runs(forced, forced, forced, forced) if high == low else _Runs(None, forced, 0, forced)
        # Copies follow each other: one copy's forced tail runs into the next copy's forced head.
        longest = max(inner.longest, inner.suffix + inner.prefix if low > 1 else 0)
        return _Runs(None, inner.prefix, inner.suffix if high == low else 0, longest)
    if op == _c.BRANCH:
        branches = av[1]
        firsts = [_first_literal(branch, icase) for branch in branches]
        # A branch's opening run is forced only once its first character has picked it: when that character is
        # a literal no other branch can start with. Otherwise only runs inside the branches count, which may
        # under-count (``a{40000}|a{20000}b`` forces 20,000 and counts 0) but never refuses a cheap regex.
        distinct = None not in firsts and len(set(firsts)) == len(firsts)
        runs = [_seq(branch, icase) for branch in branches]
        return _Runs(None, 0, 0, max(r.longest if distinct else _inner(r) for r in runs))
    return _BREAK


def _inner(runs: _Runs) -> int:
    """The longest run of a branch that does not start it (an upper bound would be ``runs.longest``)."""
    return runs.longest if runs.longest > runs.prefix else 0


def _first_literal(items: Any, icase: bool) -> int | None:
    """The character every match of ``items`` starts with, when it is one literal; else None."""
    for op, av in items:
        if op in _ZERO_WIDTH:
            continue
        if op == _c.LITERAL:
            return None if _is_choice(av, icase) else av
        if op == _c.SUBPATTERN:
            return _first_literal(av[-1], _group_icase(av, icase))
        if op in _REPEATS and av[0] >= 1:
            return _first_literal(av[2], icase)
        return None
    return None


# Set syntax that Rust's regex (llguidance) reads as nested or combined classes and Python as literals.
_RUST_CLASS_SYNTAX = ("[[", "&&", "--", "~~")


def forced_run(pattern: str) -> int | None:
    """The longest stretch of characters ``pattern`` forces; ``None`` where Python cannot parse it or may read
    it differently from the backend (nested or combined character classes)."""
    if any(token in pattern for token in _RUST_CLASS_SYNTAX):
        return None
    try:
        parsed = _parser.parse(pattern)
        return _seq(parsed, bool(parsed.state.flags & _c.SRE_FLAG_IGNORECASE)).longest
    except (_c.error, RecursionError, OverflowError, ValueError):
        return None


def regex_problem(pattern: str, where: str = "the regex") -> str | None:
    """Why ``pattern`` is refused (it forces more than ``MAX_FORCED_CHARS`` characters in a row), or ``None``."""
    run = forced_run(pattern)
    if run is None or run <= MAX_FORCED_CHARS:
        return None
    return (
        f"{where} forces a stretch of {run:,} characters, more than the {MAX_FORCED_CHARS:,} allowed (counts "
        "multiply: (x{600}){600} forces 360,000): use smaller counts, or let the text vary"
    )


def schema_pattern_problem(schema: Any, path: str = "") -> tuple[str, str] | None:
    """``(JSON pointer, regex_problem)`` of the first ``pattern`` or ``patternProperties`` key of a JSON schema that
    has one (the message names the pointer too)."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            pointer = f"{path}/{_escape(key)}"
            found = None
            if key == "pattern" and isinstance(value, str):
                problem = regex_problem(value, f"the pattern at {pointer}")
                found = (pointer, problem) if problem else None
            elif key == "patternProperties" and isinstance(value, dict):
                for name in value:
                    problem = regex_problem(name, f"the key {name!r} at {pointer}")
                    if problem:
                        found = (pointer, problem)
                        break
            if found is None and key not in ("const", "enum", "default", "examples"):  # data there, not schemas
                found = schema_pattern_problem(value, pointer)
            if found is not None:
                return found
    elif isinstance(schema, list):
        for i, item in enumerate(schema):
            found = schema_pattern_problem(item, f"{path}/{i}")
            if found is not None:
                return found
    return None


def _escape(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")
