"""Exact set algebra on JSON schemas that use only the keywords the grammar backend enforces.

``negate(s)`` returns a schema accepting exactly the JSON values ``s`` rejects; ``disjoint(a, b)`` is True only
when no value satisfies both (False means "not proven", never "they overlap"). Whatever cannot be expressed
exactly raises ``CannotRewrite`` with the reason: the caller then rejects the schema instead of weakening it.

Number types are tracked as two atoms, ``integer`` and ``fraction`` (non-integer numbers): JSON Schema's
``number`` is both, ``integer`` is the first. A complement that would need "fraction only" is not expressible by
the backend and raises.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from typing import Any

Schema = dict[str, Any] | bool
Resolver = Callable[[str], Schema | None]

ATOMS = frozenset({"null", "boolean", "string", "array", "object", "integer", "fraction"})
TYPE_NAMES = ("null", "boolean", "string", "array", "object", "number", "integer")
ANY_CHAR = r"[\s\S]"
MAX_DEPTH = 48  # nesting of negations / $ref hops; deeper means a recursive schema
MAX_COMPLEMENT_CHARS = 1 << 15  # total length of the strings whose complement becomes a regex
_ESCAPE_OUTSIDE = set("\\^$.|?*+()[]{}/-")
_ESCAPE_INSIDE = set("\\]^-[")
_LIT = r"(?:[^\\.^$|?*+()\[\]{}]|\\[\\.^$|?*+()\[\]{}/-])*"
_LITERALS = re.compile(rf"\^(?:\(({_LIT}(?:\|{_LIT})*)\)|({_LIT}))\$")
_ALT_SPLIT = re.compile(r"(?<!\\)\|")
_SIMPLE_CLASS = re.compile(r"\^\[(\^?)((?:\\.|[^\\\]])+)\]([+*])\$")
# Keywords with no effect on which instances are valid (plus containers of definitions).
NEUTRAL = frozenset(
    {"$schema", "$id", "id", "$anchor", "$defs", "definitions", "$comment", "title", "description", "default"}
    | {"examples", "deprecated", "readOnly", "writeOnly", "contentMediaType", "contentEncoding", "contentSchema"}
)
VALIDATION_KEYWORDS = frozenset(
    {"type", "enum", "const", "$ref", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "format"}
    | {"minLength", "maxLength", "pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
    | {"multipleOf", "items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems", "contains"}
    | {"minContains", "maxContains", "properties", "patternProperties", "additionalProperties", "required"}
    | {"minProperties", "maxProperties", "propertyNames", "dependencies", "dependentRequired"}
    | {"dependentSchemas", "unevaluatedItems", "unevaluatedProperties", "$dynamicRef", "$recursiveRef"}
)


class CannotRewrite(Exception):
    """An exact rewrite does not exist (or is not implemented) for this construct; ``str`` says why."""


def type_atoms(name: str) -> frozenset[str]:
    if name == "number":
        return frozenset({"integer", "fraction"})
    return frozenset({name})


def declared_atoms(type_value: Any) -> frozenset[str]:
    names = [type_value] if isinstance(type_value, str) else list(type_value)
    return frozenset().union(*(type_atoms(n) for n in names))


def value_atom(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "integer" if v.is_integer() else "fraction"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def atoms_to_schema(atoms: Iterable[str]) -> Schema:
    """A schema accepting exactly the values of these atoms."""
    atoms = set(atoms)
    if not atoms:
        return False
    if atoms == ATOMS:
        return True
    if "fraction" in atoms and "integer" not in atoms:
        raise CannotRewrite("the complement contains non-integer numbers but not integers, which has no schema")
    names = sorted(a for a in atoms if a not in ("integer", "fraction"))
    if "fraction" in atoms:
        names.append("number")
    elif "integer" in atoms:
        names.append("integer")
    return {"type": names[0] if len(names) == 1 else names}


def json_equal(a: Any, b: Any) -> bool:
    """JSON Schema equality: numbers by value (1 == 1.0), booleans distinct from numbers, deep for containers."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


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


def _any_of(parts: list[Schema]) -> Schema:
    parts = [p for p in parts if p is not False]
    if any(p is True for p in parts):
        return True
    if not parts:
        return False
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


def _all_of(parts: list[Schema]) -> Schema:
    parts = [p for p in parts if p is not True]
    if any(p is False for p in parts):
        return False
    if not parts:
        return True
    return parts[0] if len(parts) == 1 else {"allOf": parts}


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


class SchemaAlgebra:
    """Negation and disjointness over schemas whose ``$ref`` targets ``resolve`` returns (already rewritten)."""

    def __init__(self, resolve: Resolver) -> None:
        self.resolve = resolve
        self.complements: dict[str, frozenset[str]] = {}  # patterns built here -> the strings they exclude

    def _target(self, ref: str) -> Schema:
        target = self.resolve(ref)
        if target is None:
            raise CannotRewrite(f"$ref {ref!r} cannot be followed")
        return target

    # ---------------------------------------------------------------- negation
    def negate(self, s: Schema, depth: int = 0, within: Schema = True) -> Schema:
        """The complement of ``s``; exact among values that satisfy ``within`` (use True for all values)."""
        if isinstance(s, bool):
            return not s
        if depth > MAX_DEPTH:
            raise CannotRewrite("negation of a recursive schema")
        parts: list[Schema] = []
        for keys, handler in _NEGATORS:
            if any(k in s for k in keys):
                parts.extend(handler(self, s, depth, within))
        for key in s:
            if key in VALIDATION_KEYWORDS and key not in _NEGATED:
                raise CannotRewrite(f"negating {key!r}")
        return _any_of(parts)

    def _neg_ref(self, s: dict[str, Any], depth: int, within: Schema) -> list[Schema]:
        return [self.negate(self._target(s["$ref"]), depth + 1, within)]

    def _neg_type(self, s: dict[str, Any], depth: int, within: Schema) -> list[Schema]:
        return [atoms_to_schema(ATOMS - declared_atoms(s["type"]))]

    def _neg_enum(self, s: dict[str, Any], depth: int, within: Schema) -> list[Schema]:
        values = list(s["enum"])
        touched = {value_atom(v) for v in values}
        if touched & {"integer", "fraction"}:
            touched |= {"integer", "fraction"}
        if touched & {"array", "object"}:
            raise CannotRewrite("negating an enum that lists arrays or objects")
        parts = [atoms_to_schema(ATOMS - touched)]
        bools = [b for b in (False, True) if not any(v is b for v in values)]
        if "boolean" in touched and bools:
            parts.append({"enum": bools})
        strings = [v for v in values if isinstance(v, str)]
        if strings:
            pattern = complement_regex(strings)
            self.complements[pattern] = frozenset(strings)
            parts.append({"type": "string", "pattern": pattern})
        numbers = sorted({float(v) for v in values if _num(v)})
        if any(math.isinf(v) for v in numbers):
            raise CannotRewrite("negating an infinite number")
        if numbers:
            bounds = [_plain(v) for v in numbers]
            parts.append({"type": "number", "exclusiveMaximum": bounds[0]})
            parts.extend(
                {"type": "number", "exclusiveMinimum": lo, "exclusiveMaximum": hi} for lo, hi in zip(bounds, bounds[1:])
            )
            parts.append({"type": "number", "exclusiveMinimum": bounds[-1]})
        return parts

    def _neg_string(self, s: dict[str, Any], depth: int, within: Schema) -> list[Schema]:
        parts: list[Schema] = []
        if s.get("minLength", 0) > 0:
            parts.append({"type": "string", "maxLength": s["minLength"] - 1})
        if "maxLength" in s:
            parts.append({"type": "string", "minLength": s["maxLength"] + 1})
        if "pattern" in s:
            parts.append({"type": "string", "pattern": negate_pattern(s["pattern"])})
        if "format" in s:
            raise CannotRewrite(f"negating format {s['format']!r}")
        return parts

    def _neg_number(self, s: dict[str, Any], depth: int, within: Schema) -> list[Schema]:
        if "multipleOf" in s:
            raise CannotRewrite("negating multipleOf")
        parts: list[Schema] = []
        emin, emax = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
        if "minimum" in s:
            parts.append({"type": "number", ("maximum" if emin is True else "exclusiveMaximum"): s["minimum"]})
        if "maximum" in s:
            parts.append({"type": "number", ("minimum" if emax is True else "exclusiveMinimum"): s["maximum"]})
        if _num(emin):
            parts.append({"type": "number", "maximum": emin})
        if _num(emax):
            parts.append({"type": "number", "minimum": emax})
        return parts

    def _neg_array(self, s: dict[str, Any], depth: int, within: Schema) -> list[Schema]:
        parts: list[Schema] = []
        if s.get("minItems", 0) > 0:
            parts.append({"type": "array", "maxItems": s["minItems"] - 1})
        if "maxItems" in s:
            parts.append({"type": "array", "minItems": s["maxItems"] + 1})
        items = s.get("items", True)
        if isinstance(items, list) or s.get("prefixItems") or s.get("additionalItems", True) not in (True, {}):
            raise CannotRewrite("negating tuple-form array items")
        if items is False or (items not in (True, {}) and self._items_disjoint(items, within)):
            parts.append({"type": "array", "minItems": 1})  # any item at all is a witness
        elif items not in (True, {}):
            raise CannotRewrite("negating items (it would need 'contains')")
        if s.get("uniqueItems"):
            raise CannotRewrite("negating uniqueItems")
        return parts

    def _neg_object(self, s: dict[str, Any], depth: int, within: Schema) -> list[Schema]:
        parts: list[Schema] = []
        for name in s.get("required", []):
            parts.append({"type": "object", "properties": {name: False}})
        rest = s.get("additionalProperties", True)
        if s.get("patternProperties") or (rest not in (True, {}) and self.closed_keys(within) is None):
            raise CannotRewrite("negating additionalProperties / patternProperties")
        if rest not in (True, {}):  # among objects limited to known keys, a witness is one of the extra keys
            for name in sorted((self.closed_keys(within) or frozenset()) - set(s.get("properties", {}))):
                neg = self.negate(rest, depth + 1)
                if neg is not False:
                    parts.append({"type": "object", "required": [name], "properties": {name: neg}})
        for name, sub in s.get("properties", {}).items():
            neg = self.negate(sub, depth + 1)
            if neg is not False:
                parts.append({"type": "object", "required": [name], "properties": {name: neg}})
        if s.get("minProperties", 0) > 0:
            parts.append({"type": "object", "maxProperties": s["minProperties"] - 1})
        if "maxProperties" in s:
            parts.append({"type": "object", "minProperties": s["maxProperties"] + 1})
        return parts

    def _neg_all_of(self, s: dict[str, Any], depth: int, within: Schema) -> list[Schema]:
        return [self.negate(m, depth + 1, within) for m in s["allOf"]]

    def _neg_any_of(self, s: dict[str, Any], depth: int, within: Schema) -> list[Schema]:
        return [_all_of([self.negate(m, depth + 1, within) for m in s["anyOf"]])]

    def _neg_not(self, s: dict[str, Any], depth: int, within: Schema) -> list[Schema]:
        return [s["not"]]

    # ------------------------------------------------------------ disjointness
    def types(self, s: Schema, depth: int = 0) -> frozenset[str]:
        """A superset of the atoms of the values ``s`` accepts."""
        if s is False:
            return frozenset()
        if s is True or depth > MAX_DEPTH:
            return ATOMS
        out = ATOMS
        if "type" in s:
            out &= declared_atoms(s["type"])
        if "enum" in s:
            out &= frozenset(value_atom(v) for v in s["enum"])
        for m in s.get("allOf", []):
            out &= self.types(m, depth + 1)
        if "anyOf" in s:
            out &= frozenset().union(*(self.types(m, depth + 1) for m in s["anyOf"]))
        if "$ref" in s:
            target = self.resolve(s["$ref"])
            if target is not None:
                out &= self.types(target, depth + 1)
        return out

    def disjoint(self, a: Schema, b: Schema, depth: int = 0) -> bool:
        """True when no JSON value satisfies both ``a`` and ``b`` (a sound, incomplete proof)."""
        if a is False or b is False:
            return True
        if a is True or b is True or depth > MAX_DEPTH:
            return False
        for x, y in ((a, b), (b, a)):
            if "$ref" in x:
                target = self.resolve(x["$ref"])
                if target is not None and self.disjoint(target, y, depth + 1):
                    return True
            if any(self.disjoint(m, y, depth + 1) for m in x.get("allOf", [])):
                return True
            if "anyOf" in x and all(self.disjoint(m, y, depth + 1) for m in x["anyOf"]):
                return True
        common = self.types(a, depth) & self.types(b, depth)
        return all(self._disjoint_on(atom, a, b, depth) for atom in common)

    def _disjoint_on(self, atom: str, a: dict[str, Any], b: dict[str, Any], depth: int) -> bool:
        va, vb = _values(a, atom), _values(b, atom)
        if va is not None and vb is not None:
            return not any(json_equal(x, y) for x in va for y in vb)
        if va is not None:
            return all(self.excludes(b, v, depth + 1) for v in va)
        if vb is not None:
            return all(self.excludes(a, v, depth + 1) for v in vb)
        if atom == "object":
            return self._objects_disjoint(a, b, depth)
        if atom in ("integer", "fraction"):
            return _ranges_disjoint(_num_range(a), _num_range(b))
        if atom == "string":
            return _ranges_disjoint(_len_range(a, "Length"), _len_range(b, "Length"))
        if atom == "array":
            return _ranges_disjoint(_len_range(a, "Items"), _len_range(b, "Items"))
        return False

    def _objects_disjoint(self, a: dict[str, Any], b: dict[str, Any], depth: int) -> bool:
        va, vb = self._object_view(a), self._object_view(b)
        # A name one side requires must carry a value the other side's constraint on that name rejects.
        return any(
            self.disjoint(_all_of(va.schemas(k)), _all_of(vb.schemas(k)), depth + 1) for k in va.required | vb.required
        )

    def closed_keys(self, s: Schema) -> frozenset[str] | None:
        """The only property names an object satisfying ``s`` can have, when ``s`` closes the object."""
        keys: frozenset[str] | None = None
        for h in self._object_view(s).holders:
            if h.get("additionalProperties") is False and not h.get("patternProperties"):
                names = frozenset(k for k, v in h.get("properties", {}).items() if v is not False)
                keys = names if keys is None else keys & names
        return keys

    def _items_disjoint(self, items: Schema, within: Schema) -> bool:
        """True when every item of an array satisfying ``within`` lies outside ``items``."""
        for h in self._object_view(within).holders:
            other = h.get("items")
            if isinstance(other, dict | bool) and self.disjoint(items, other):
                return True
        return False

    def _object_view(self, s: Schema) -> _ObjectView:
        """Required names and per-name constraints of ``s`` gathered through ``allOf`` and ``$ref``."""
        view = _ObjectView()
        stack, seen = [s], 0
        while stack and seen < 256:
            x = stack.pop()
            seen += 1
            if not isinstance(x, dict):
                continue
            view.required |= set(x.get("required", []))
            view.holders.append(x)
            stack.extend(x.get("allOf", []))
            if "$ref" in x:
                target = self.resolve(x["$ref"])
                if target is not None:
                    stack.append(target)
        return view

    # ------------------------------------------------------------ intersection
    def intersect(self, a: Schema, b: Schema, depth: int = 0) -> Schema | None:
        """One schema without a reference at the top that means ``a`` and ``b``; None when not computed.

        Covers bare references, unions (branches provably disjoint from the other side are dropped), arrays and
        plain objects; per-property constraints are combined with ``allOf``. Exact where it answers.
        """
        a, b = self._deref(a), self._deref(b)
        if a is True or b is True:
            return b if a is True else a
        if a is False or b is False or depth > MAX_DEPTH:
            return False if a is False or b is False else None
        if "anyOf" in b:
            a, b = b, a
        if "anyOf" in a:
            rest = {k: v for k, v in a.items() if k != "anyOf"}
            base = self.intersect(b, rest, depth + 1) if rest else b
            if base is None:
                return None
            parts = [self.intersect(opt, base, depth + 1) for opt in a["anyOf"] if not self.disjoint(opt, base)]
            return None if any(p is None for p in parts) else _any_of(parts)
        kinds = {a.get("type"), b.get("type")}
        if kinds == {"array"} and set(a) | set(b) <= _ARRAY_KEYS:
            items = self.intersect(a.get("items", True), b.get("items", True), depth + 1)
            if items is None:
                return None
            out: dict[str, Any] = {"type": "array", "items": items}
            if "minItems" in a or "minItems" in b:
                out["minItems"] = max(a.get("minItems", 0), b.get("minItems", 0))
            if "maxItems" in a or "maxItems" in b:
                out["maxItems"] = min(a.get("maxItems", math.inf), b.get("maxItems", math.inf))
            return out
        if kinds == {"object"} and set(a) | set(b) <= _OBJECT_KEYS:
            return _merge_objects(a, b)
        return None

    def _deref(self, s: Schema) -> Schema:
        for _ in range(8):
            if not (isinstance(s, dict) and set(s) - NEUTRAL == {"$ref"}):
                break
            target = self.resolve(s["$ref"])
            if target is None:
                break
            s = target
        return {k: v for k, v in s.items() if k not in NEUTRAL} if isinstance(s, dict) else s

    def excludes(self, s: Schema, v: Any, depth: int = 0) -> bool:
        """True when ``s`` surely rejects the value ``v``."""
        if isinstance(s, bool) or depth > MAX_DEPTH:
            return s is False
        if value_atom(v) not in self.types(s, depth):
            return True
        if "enum" in s and not any(json_equal(v, e) for e in s["enum"]):
            return True
        if isinstance(v, dict):
            view = self._object_view(s)
            if any(k not in v for k in view.required):
                return True
            if any(self.excludes(_all_of(view.schemas(k)), x, depth + 1) for k, x in v.items()):
                return True
        if isinstance(v, str) and not _in_range(len(v), _len_range(s, "Length")):
            return True
        if isinstance(v, str) and isinstance(s.get("pattern"), str):
            literals = literal_pattern(s["pattern"])
            if (literals is not None and v not in literals) or v in self.complements.get(s["pattern"], ()):
                return True
        if _num(v) and not _in_range(v, _num_range(s)):
            return True
        if "$ref" in s:
            target = self.resolve(s["$ref"])
            if target is not None and self.excludes(target, v, depth + 1):
                return True
        if any(self.excludes(m, v, depth + 1) for m in s.get("allOf", [])):
            return True
        return "anyOf" in s and all(self.excludes(m, v, depth + 1) for m in s["anyOf"])


_ARRAY_KEYS = frozenset({"type", "items", "minItems", "maxItems"})
_OBJECT_KEYS = frozenset({"type", "properties", "required", "additionalProperties"})


def _merge_objects(a: dict[str, Any], b: dict[str, Any]) -> Schema:
    """``a`` and ``b`` as one object schema (both use only type/properties/required/additionalProperties)."""
    ra, rb = a.get("additionalProperties", True), b.get("additionalProperties", True)
    pa, pb = a.get("properties", {}), b.get("properties", {})
    props = {k: _all_of([pa.get(k, ra), pb.get(k, rb)]) for k in [*pa, *(k for k in pb if k not in pa)]}
    out: dict[str, Any] = {"type": "object", "properties": props}
    required = [*a.get("required", []), *(k for k in b.get("required", []) if k not in a.get("required", []))]
    if any(props.get(k) is False for k in required):
        return False
    if required:
        out["required"] = required
    rest = _all_of([ra, rb])
    if rest is not True:
        out["additionalProperties"] = rest
    return out


def _values(s: dict[str, Any], atom: str) -> list[Any] | None:
    """The finite set of ``atom`` values ``s`` allows (from enum, or a literal pattern), None when unbounded."""
    values = [v for v in s["enum"] if value_atom(v) == atom] if "enum" in s else None
    if atom == "string" and isinstance(s.get("pattern"), str):
        literals = literal_pattern(s["pattern"])
        if literals is not None:
            values = literals if values is None else [v for v in values if v in literals]
    return values


def _plain(v: float) -> int | float:
    return int(v) if v.is_integer() and abs(v) < 2**53 else v


class _ObjectView:
    """What an object must satisfy per property name, from several conjoined schemas (sound, not complete)."""

    def __init__(self) -> None:
        self.required: set[str] = set()
        self.holders: list[dict[str, Any]] = []

    def schemas(self, key: str) -> list[Schema]:
        """Schemas a value under ``key`` must satisfy; holders with patternProperties are skipped (unknown)."""
        out: list[Schema] = []
        for h in self.holders:
            props = h.get("properties", {})
            if key in props:
                out.append(props[key])
            elif "additionalProperties" in h and not h.get("patternProperties"):
                out.append(h["additionalProperties"])
        return out


Range = tuple[float, bool, float, bool]  # low, low exclusive, high, high exclusive


def _num_range(s: dict[str, Any]) -> Range:
    lo, lo_x, hi, hi_x = -math.inf, False, math.inf, False
    emin, emax = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
    if _num(s.get("minimum")):
        lo, lo_x = s["minimum"], emin is True
    if _num(s.get("maximum")):
        hi, hi_x = s["maximum"], emax is True
    if _num(emin) and emin >= lo:
        lo, lo_x = emin, True
    if _num(emax) and emax <= hi:
        hi, hi_x = emax, True
    return lo, lo_x, hi, hi_x


def _len_range(s: dict[str, Any], what: str) -> Range:
    lo, hi = s.get(f"min{what}", 0), s.get(f"max{what}", math.inf)
    return (lo if _num(lo) else 0), False, (hi if _num(hi) else math.inf), False


def _ranges_disjoint(a: Range, b: Range) -> bool:
    def before(x: Range, y: Range) -> bool:  # everything in x lies below everything in y
        return x[2] < y[0] or (x[2] == y[0] and (x[3] or y[1]))

    return before(a, b) or before(b, a)


def _in_range(v: float, r: Range) -> bool:
    lo, lo_x, hi, hi_x = r
    return (v > lo if lo_x else v >= lo) and (v < hi if hi_x else v <= hi)


_NEGATORS: tuple[tuple[tuple[str, ...], Callable[[SchemaAlgebra, dict[str, Any], int, Schema], list[Schema]]], ...] = (
    (("$ref",), SchemaAlgebra._neg_ref),
    (("type",), SchemaAlgebra._neg_type),
    (("enum",), SchemaAlgebra._neg_enum),
    (("minLength", "maxLength", "pattern", "format"), SchemaAlgebra._neg_string),
    (("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"), SchemaAlgebra._neg_number),
    (("minItems", "maxItems", "items", "prefixItems", "additionalItems", "uniqueItems"), SchemaAlgebra._neg_array),
    (
        ("required", "properties", "patternProperties", "additionalProperties", "minProperties", "maxProperties"),
        SchemaAlgebra._neg_object,
    ),
    (("allOf",), SchemaAlgebra._neg_all_of),
    (("anyOf",), SchemaAlgebra._neg_any_of),
    (("not",), SchemaAlgebra._neg_not),
)
_NEGATED = frozenset(k for keys, _ in _NEGATORS for k in keys)
