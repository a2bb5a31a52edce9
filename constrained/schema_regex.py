"""Regular-expression helpers of the rewriter: complements of finite string sets and of simple class patterns,
literal patterns, and deciding ``pattern`` on property names where ECMAScript and Python agree.

Generated patterns use only syntax that ECMAScript, Rust ``regex`` (llguidance) and Python read alike.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from radixserve.constrained.schema_types import CannotRewrite

ANY_CHAR = r"[\s\S]"

MAX_COMPLEMENT_CHARS = 1 << 15  # total length of the strings whose complement becomes a regex

_ESCAPE_OUTSIDE = set("\\^$.|?*+()[]{}/-")

_ESCAPE_INSIDE = set("\\]^-[")

_LIT = r"(?:[^\\.^$|?*+()\[\]{}]|\\[\\.^$|?*+()\[\]{}/-])*"

_LITERALS = re.compile(rf"\^(?:\(({_LIT}(?:\|{_LIT})*)\)|({_LIT}))\$")

_ALT_SPLIT = re.compile(r"(?<!\\)\|")

_SIMPLE_CLASS = re.compile(r"\^\[(\^?)((?:\\.|[^\\\]])+)\]([+*])\$")


def _escape(c: str, inside_class: bool) -> str:
    return "\\" + c if c in (_ESCAPE_INSIDE if inside_class else _ESCAPE_OUTSIDE) else c


def complement_regex(words: Iterable[str]) -> str:
    """An anchored pattern matching every string except the given ones (built on their trie)."""
    words = sorted(set(words))
    if sum(len(w) for w in words) > MAX_COMPLEMENT_CHARS:
        raise CannotRewrite(f"excluding strings totalling more than {MAX_COMPLEMENT_CHARS} characters")
    trie: dict[str, Any] = {}
    for w in words:
        node = trie
        for c in w:
            node = node.setdefault(c, {})
        node[""] = {}

    def build(node: dict[str, Any]) -> str:
        alts = [] if "" in node else [""]
        chars = sorted(c for c in node if c)
        if chars:
            alts.append("[^" + "".join(_escape(c, True) for c in chars) + "]" + ANY_CHAR + "*")
            alts.extend(_escape(c, False) + build(node[c]) for c in chars)
        else:
            alts.append(ANY_CHAR + "+")
        return alts[0] if len(alts) == 1 and alts[0] else "(" + "|".join(alts) + ")"

    if max((len(w) for w in words), default=0) > 256:
        raise CannotRewrite("excluding a string longer than 256 characters")
    return "^" + build(trie) + "$"


def literal_pattern(pattern: str) -> list[str] | None:
    """The strings ``^(a|b|...)$`` matches when the pattern is an escaped literal or a union of them; else None."""
    m = _LITERALS.fullmatch(pattern)
    if m is None:
        return None
    body = m.group(1) if m.group(1) is not None else m.group(2)
    return [re.sub(r"\\(.)", r"\1", alt) for alt in _ALT_SPLIT.split(body)]


def negate_pattern(pattern: str) -> str:
    """The complement of ``^[class]+$`` / ``^[class]*$`` (and negated classes) as a pattern."""
    m = _SIMPLE_CLASS.fullmatch(pattern)
    if m is None:
        raise CannotRewrite(f"negating the regular expression {pattern!r} (only ^[...]+$ / ^[...]*$ forms are)")
    negated, body, quant = m.groups()
    breaker = f"[{body}]" if negated else f"[^{body}]"
    hit = f"{ANY_CHAR}*{breaker}{ANY_CHAR}*"
    return f"^({hit})$" if quant == "*" else f"^(|{hit})$"


_SAFE_PATTERN = re.compile(r"(?:[^\\]|\\[.\-dw/\\^$*+?()\[\]{}|])*")


def name_matches(pattern: str, name: str) -> bool | None:
    """Whether ECMAScript ``pattern`` finds a match in the property name ``name``; None when unsure.

    Decided with Python's ``re`` only where both engines agree: ASCII names without line breaks, and patterns
    without lookaround, back-references, flags or escapes other than ``\\d``, ``\\w`` and escaped punctuation.
    """
    if len(pattern) > 256 or not name.isascii() or "\n" in name or "\r" in name or "(?" in pattern:
        return None
    if not _SAFE_PATTERN.fullmatch(pattern) or not pattern.isascii():
        return None
    try:
        return re.search(pattern, name, re.ASCII) is not None
    except re.error:
        return None


_LOOKAHEAD_LITERAL = r"(?:[A-Za-z0-9_@#%&=:;,<>'\"!~` -]|\\[.\-\\^$*+?()\[\]{}|/])+"
_LOOKAHEAD = re.compile(rf"\^\(\?!({_LOOKAHEAD_LITERAL})\)\[((?:\\.|[^\\\]])+)\]\+\$")
_CLASS_ITEM = re.compile(r"\\.|.-[^\]]|.")


def drop_lookahead(pattern: str) -> str | None:
    """``^(?!L)[C]+$`` (a literal ``L`` refused at the start of a one-class string) without the look-ahead.

    The backend has no look-around; the same language is "a non-empty string over C that leaves L at some
    position j": L[:j] followed by a class character other than L[j], or a proper non-empty prefix of L. Needs
    each L[j] to be a literal item of the class that no other item covers; None when the pattern is not of this
    form (it is then left to the backend, which reports it).
    """
    m = _LOOKAHEAD.fullmatch(pattern)
    if m is None:
        return None
    literal = re.sub(r"\\(.)", r"\1", m.group(1))
    body = m.group(2)
    items = _CLASS_ITEM.findall(body)
    alts = []
    for j, c in enumerate(literal):
        rest = [it for it in items if it not in (c, "\\" + c)]
        if len(rest) == len(items) and re.fullmatch(f"[{body}]", c, re.ASCII) is None:
            # c is outside the class, so L cannot occur past here: any continuation is fine
            alts.append(f"{_esc(literal[:j])}[{body}]*" if j else f"[{body}]+")
            break
        if not rest or re.fullmatch(f"[{''.join(rest)}]", c, re.ASCII) is not None:
            return None  # another item also covers c: cannot subtract it from the class
        alts.append(f"{_esc(literal[:j])}[{''.join(rest)}][{body}]*")
        if j:
            alts.append(_esc(literal[:j]))
    return "^(" + "|".join(dict.fromkeys(alts)) + ")$"


def _esc(text: str) -> str:
    return "".join(_escape(c, False) for c in text)
