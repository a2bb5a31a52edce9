"""Regexes that force very long stretches of text, refused before compiling.

Where a regex leaves only one way to go on (``x{n}``, a literal), a grammar backend computes the whole forced
stretch: llguidance spends ~1.5 ms per 1,000 forced characters of lexer and tokenizer work, and nested counts
multiply (``(b{600}){600}`` forces 360,000 characters: ~1 s per compile, or a stall while decoding once the
stretch is reached). Optional and branching repetitions are cheap however large (``[ab]{300000}``,
``(a{600}){0,600}``: ~1 ms). So the measure is the longest forced run, computed on Python's parse of the pattern
in microseconds; a constraint over ``MAX_FORCED_CHARS`` is refused when submitted (``ConstraintSpec.validate``),
before it costs a compile worker any time. Patterns Python cannot parse (syntax only the backend knows) are left to
the backend and its own limits.
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


def _seq(items: Any) -> _Runs:
    fixed: int | None = 0
    prefix = run = longest = 0
    for op, av in items:
        part = _item(op, av)
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


def _item(op: Any, av: Any) -> _Runs:
    if op == _c.LITERAL:
        return _Runs(1, 1, 1, 1)
    if op in _ZERO_WIDTH:
        return _Runs(0, 0, 0, 0)
    if op == _c.SUBPATTERN:
        return _seq(av[-1])
    if op == getattr(_c, "ATOMIC_GROUP", None):
        return _seq(av)
    if op in _REPEATS:
        low, high, sub = av
        inner = _seq(sub)
        if low == 0:
            return _Runs(0 if high == 0 else None, 0, 0, inner.longest)
        if inner.fixed is not None:
            forced = low * inner.fixed
            return _Runs(forced, forced, forced, forced) if high == low else _Runs(None, forced, 0, forced)
        # Copies follow each other: one copy's forced tail runs into the next copy's forced head.
        longest = max(inner.longest, inner.suffix + inner.prefix if low > 1 else 0)
        return _Runs(None, inner.prefix, inner.suffix if high == low else 0, longest)
    if op == _c.BRANCH:
        return _Runs(None, 0, 0, max(_seq(branch).longest for branch in av[1]))
    return _BREAK


def forced_run(pattern: str) -> int | None:
    """The longest stretch of characters ``pattern`` forces; ``None`` if Python cannot parse it."""
    try:
        return _seq(_parser.parse(pattern)).longest
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


def schema_pattern_problem(schema: Any, path: str = "") -> str | None:
    """``regex_problem`` of the first ``pattern`` or ``patternProperties`` key of a JSON schema that has one,
    naming its JSON pointer."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            pointer = f"{path}/{_escape(key)}"
            problem = None
            if key == "pattern" and isinstance(value, str):
                problem = regex_problem(value, f"the pattern at {pointer}")
            elif key == "patternProperties" and isinstance(value, dict):
                problem = next(
                    (p for name in value if (p := regex_problem(name, f"the key {name!r} at {pointer}"))), None
                )
            if problem is None and key not in ("const", "enum", "default", "examples"):  # data there, not schemas
                problem = schema_pattern_problem(value, pointer)
            if problem is not None:
                return problem
    elif isinstance(schema, list):
        for i, item in enumerate(schema):
            problem = schema_pattern_problem(item, f"{path}/{i}")
            if problem is not None:
                return problem
    return None


def _escape(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")
