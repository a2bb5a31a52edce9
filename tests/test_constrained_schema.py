"""The JSON-schema rewriter: every rewrite keeps the accepted instance set, and what cannot be kept is refused.

Exactness is checked with the ``jsonschema`` validator: the original and the rewritten schema must judge every
probe instance the same way. No tokenizer or model is needed here.
"""

from __future__ import annotations

import re
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.constrained.json_schema import as_draft_2020, rewrite_schema
from radixserve.constrained.schema_regex import complement_regex, negate_pattern
from radixserve.constrained.spec import ConstraintSpec, GrammarError

jsonschema = pytest.importorskip("jsonschema")

FORMATS = frozenset({"date", "date-time", "email", "uri", "uuid"})
PROBES = [
    None,
    True,
    False,
    0,
    1,
    1.5,
    -3,
    "",
    "a",
    "abc",
    "staff",
    "x y",
    [],
    [1],
    ["a", "b"],
    {},
    {"a": 1},
    {"a": "x"},
    {"b": 2},
    {"a": 1, "b": 2},
    {"a": 1, "b": "s", "c": None},
    {"type": "circle", "r": 1},
    {"type": "square", "side": 2},
    {"type": "square", "r": 1},
    {"kind": "x", "a": 1},
]


def validators(schema: dict, rewritten: dict) -> tuple:
    """Validators for the original and the rewritten schema, both in the original's draft."""
    cls = jsonschema.validators.validator_for(schema)
    if cls in (jsonschema.Draft202012Validator, jsonschema.Draft201909Validator):
        rewritten = as_draft_2020(rewritten)
    return cls(schema), cls(rewritten)


def assert_exact(schema: dict, probes: list | None = None) -> dict:
    rewritten = rewrite_schema(schema, FORMATS)
    original, ours = validators(schema, rewritten)
    for inst in PROBES + (probes or []):
        assert original.is_valid(inst) == ours.is_valid(inst), (inst, rewritten)
    return rewritten


def refused(schema: dict) -> GrammarError:
    with pytest.raises(GrammarError) as info:
        rewrite_schema(schema, FORMATS)
    return info.value


def test_const_and_tuple_forms() -> None:
    out = assert_exact({"type": "object", "properties": {"a": {"const": 1}}})
    assert out["properties"]["a"] == {"enum": [1]}
    assert_exact({"type": "array", "prefixItems": [{"type": "string"}], "items": False}, [["a", 1], ["a"]])
    assert_exact({"enum": [1, 2], "const": 2}, [2, 1])


def test_dependencies_all_forms() -> None:
    draft7 = "http://json-schema.org/draft-07/schema#"
    assert_exact({"$schema": draft7, "dependencies": {"a": ["b"]}})
    assert_exact({"dependentRequired": {"a": ["b"]}, "properties": {"a": {}, "b": {}}, "additionalProperties": False})
    assert_exact({"dependentSchemas": {"a": {"properties": {"b": {"type": "integer"}}}}})
    assert_exact({"$schema": draft7, "dependencies": {"a": {"required": ["c"]}}, "required": ["a"]}, [{"a": 1, "c": 1}])


def test_not_is_an_exact_complement() -> None:
    assert rewrite_schema({"properties": {"a": {"not": {}}}}, FORMATS)["properties"]["a"] == {"allOf": [False]}
    assert_exact({"type": "string", "not": {"enum": ["staff", "abc"]}}, ["staf", "staffs", "abcd"])
    assert_exact({"not": {"required": ["a", "b"]}})
    assert_exact({"not": {"type": ["string", "null"]}})
    assert_exact({"not": {"enum": [1, 1.5, "a", True]}}, [2, 1.25, "b"])
    assert_exact({"type": "string", "not": {"pattern": "^[.\\-\\s]+$"}}, ["..", ". -", "a.", " "])
    assert_exact({"not": {"anyOf": [{"type": "string"}, {"minimum": 1}]}}, [0.5, 2])


def test_if_then_else() -> None:
    schema = {
        "type": "object",
        "if": {"properties": {"type": {"const": "circle"}}},
        "then": {"required": ["r"]},
        "else": {"required": ["side"]},
    }
    assert_exact(schema)


def test_conditionals_on_one_property_are_fused_not_multiplied() -> None:
    branches = [
        {"if": {"properties": {"kind": {"const": f"k{i}"}}}, "then": {"required": [f"p{i}"]}} for i in range(40)
    ]
    schema = {"type": "object", "required": ["kind"], "allOf": branches}
    out = assert_exact(schema, [{"kind": "k3", "p3": 1}, {"kind": "k3"}, {"kind": "other"}, {"kind": 5}])
    assert len(out["allOf"]) == 1 and len(out["allOf"][0]["anyOf"]) <= 42


def test_one_of_disjoint_becomes_any_of() -> None:
    schema = {
        "definitions": {"c": {"properties": {"type": {"const": "circle"}}, "required": ["type"]}},
        "oneOf": [{"$ref": "#/definitions/c"}, {"type": "string"}, {"type": "null"}],
    }
    out = assert_exact(schema)
    assert "oneOf" not in str(out) and out["allOf"][0]["anyOf"]


def test_one_of_overlapping_is_expanded_exactly() -> None:
    schema = {
        "type": "object",
        "oneOf": [{"required": ["a"]}, {"required": ["b"]}],
    }
    assert_exact(schema)
    closed = {
        "oneOf": [
            {"properties": {"a": {"type": "integer"}}, "additionalProperties": False},
            {"properties": {"b": {"type": "integer"}}, "additionalProperties": False},
        ]
    }
    assert_exact(closed)


def test_one_of_overlapping_numbers_is_negated_within_its_type() -> None:
    """Negating an integer branch within integers needs no "non-integer number" schema (which has none)."""
    numbers = [-1, 0, 4, 5, 10, 11, 20, 21, 2.5, 7.5, 5.0, -0.5]
    ranges = {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"type": "integer", "minimum": 5}]}
    assert_exact(ranges, numbers)
    assert_exact({"type": "integer", "oneOf": [{"minimum": 0, "maximum": 10}, {"minimum": 5, "maximum": 20}]}, numbers)
    assert_exact({"type": "integer", "oneOf": [{"type": "integer"}, {"type": "number", "maximum": 5}]}, numbers)
    assert_exact({"type": "integer", "oneOf": [{"enum": [1, 2, "a"]}, {"maximum": 1}]}, numbers)
    # Among all numbers, "not an integer" stays inexpressible: refused, not approximated.
    assert refused({"oneOf": [{"type": "integer"}, {"type": "number", "maximum": 5}]}).keyword == "oneOf"


def test_property_names() -> None:
    assert_exact({"propertyNames": {"enum": ["a", "b"]}, "additionalProperties": {"type": "integer"}})
    assert_exact({"propertyNames": {"pattern": "^[ab]$"}, "properties": {"c": {}}}, [{"c": 1}])
    assert_exact({"propertyNames": {"pattern": "^[a-z]+$"}, "patternProperties": {".*": {"type": "integer"}}})
    names = {"enum": ["a", "b", "cc"], "pattern": "^[a-z]$"}
    both = {"propertyNames": names, "additionalProperties": {"type": "integer"}}
    assert set(assert_exact(both, [{"cc": 1}, {"b": 1, "cc": 2}])["properties"]) == {"a", "b"}
    strings = {"propertyNames": {"type": "string"}, "patternProperties": {"^x": {"type": "integer"}}}
    assert "propertyNames" not in assert_exact(strings, [{"x1": 1}, {"x1": "s"}, {"y": None}])


def test_annotations_and_unknown_formats_are_not_constraints() -> None:
    out = rewrite_schema({"type": "string", "title": "t", "examples": ["x"], "format": "color"}, FORMATS)
    assert out == {"type": "string"}
    assert rewrite_schema({"type": "string", "format": "email"}, FORMATS)["format"] == "email"


def test_unevaluated_keywords_where_they_mean_additional() -> None:
    assert_exact({"properties": {"a": {}}, "unevaluatedProperties": {"type": "integer"}})
    assert_exact({"prefixItems": [{"type": "string"}], "unevaluatedItems": False}, [["a", 1], ["a"]])
    err = refused({"allOf": [{"properties": {"a": {}}}], "unevaluatedProperties": False})
    assert err.keyword == "unevaluatedProperties" and err.pointer == ""


def test_trivial_keywords_are_dropped() -> None:
    assert "uniqueItems" not in rewrite_schema({"type": "array", "uniqueItems": True, "maxItems": 1}, FORMATS)
    assert "uniqueItems" not in rewrite_schema({"type": "array", "uniqueItems": False}, FORMATS)
    assert_exact({"type": "object", "required": ["a"], "minProperties": 1})


def test_unsupported_keywords_are_refused_with_their_pointer() -> None:
    err = refused({"properties": {"tags": {"type": "array", "uniqueItems": True}}})
    assert err.kind == "unsupported" and err.keyword == "uniqueItems" and err.pointer == "/properties/tags"
    assert "unsupported JSON-schema keyword 'uniqueItems' at /properties/tags" in str(err)
    assert refused({"type": "array", "contains": {"const": 1}}).keyword == "contains"
    assert refused({"$dynamicRef": "#a"}).keyword == "$dynamicRef"
    err = refused({"type": "object", "properties": {"a": {}}, "minProperties": 1})
    assert err.keyword == "minProperties" and err.pointer == ""
    err = refused({"items": {"not": {"pattern": "^a(b|c)$"}}})
    assert err.keyword == "not" and err.pointer == "/items/not"


def test_invalid_schemas_are_refused_with_their_pointer() -> None:
    err = refused({"properties": {"a": {"type": "strng"}}})
    assert err.kind == "invalid" and err.pointer == "/properties/a/type"
    assert refused({"required": "a"}).pointer == "/required"
    assert refused({"minLength": -1}).pointer == "/minLength"
    assert refused({"properties": {"n": {"multipleOf": -2}}}).pointer == "/properties/n/multipleOf"
    assert refused({"allOf": []}).pointer == "/allOf"
    assert refused({"$ref": "#/definitions/missing"}).keyword == "$ref"
    with pytest.raises(GrammarError):
        ConstraintSpec("json_schema", "{not json")


def test_unused_definitions_cannot_fail_and_refs_into_rewritten_keywords_resolve() -> None:
    schema = {
        "definitions": {"unused": {"uniqueItems": True, "type": "array"}, "s": {"type": "string"}},
        "not": {"$ref": "#/definitions/s"},
        "properties": {"x": {"$ref": "#/not"}},
    }
    assert_exact(schema, [{"x": "s"}, {"x": 1}])


def test_recursive_schema_with_ref_siblings() -> None:
    schema = {
        "definitions": {"node": {"properties": {"kids": {"type": "array", "items": {"$ref": "#/definitions/node"}}}}},
        "type": "object",
        "$ref": "#/definitions/node",
    }
    assert_exact(schema, [{"kids": [{"kids": []}]}, {"kids": [1]}])


def test_pathological_nesting_is_refused_cleanly() -> None:
    deep: dict = {"type": "string"}
    for _ in range(5000):
        deep = {"items": deep}
    assert refused(deep).kind == "too_complex"


def test_number_bounds_the_backend_cannot_hold_move_inward() -> None:
    """The backend reads bounds as doubles (and number bounds as their shortest decimal text), moves exclusive
    integer bounds by one in doubles, and cannot compile +-2**63: such bounds narrow, never widen."""
    int64 = rewrite_schema({"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}, FORMATS)
    assert int64 == {"type": "integer", "minimum": -9 * 10**18, "maximum": 9 * 10**18}
    odd = 2**53 + 3  # between the doubles 2**53 + 2 and 2**53 + 4
    out = rewrite_schema({"type": "integer", "maximum": odd, "exclusiveMinimum": -odd}, FORMATS)
    assert out == {"type": "integer", "maximum": 2**53 - 2, "minimum": -(2**53 + 2)}
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "maximum": 2**54, "exclusiveMaximum": True}
    for schema, key, bound, inside in [
        ({"exclusiveMinimum": 2**54}, "minimum", 2**54, 1),
        (draft4, "maximum", 2**54, -1),
        ({"maximum": 2**60}, "maximum", 2**60 + 1, -1),  # llguidance read this one as 1152921504606847000
        ({"minimum": -(10**18) - 7}, "minimum", -(10**18) - 8, 1),
    ]:
        held = rewrite_schema(schema, FORMATS)[key]
        assert (held - bound) * inside > 0 and abs(held - bound) < 10**10, (schema, held)
        assert float(held) == held and Decimal(repr(float(held))) == held  # exact as a double and as its text
    nested = rewrite_schema({"properties": {"n": {"anyOf": [{"exclusiveMaximum": 1e30}, {"type": "string"}]}}}, FORMATS)
    assert nested["properties"]["n"]["anyOf"][0] == {"maximum": 9 * 10**18}
    for exact in ({"type": "integer", "minimum": -(2**53), "maximum": 2**53}, {"type": "number", "maximum": 4.5e18}):
        assert rewrite_schema(exact, FORMATS) == exact
    far = {"type": "integer", "minimum": 10**30}  # nothing inward to move to: left for the backend to refuse
    assert rewrite_schema(far, FORMATS) == far
    narrow = {"type": "integer", "minimum": 2**53 + 1, "maximum": 2**53 + 7}  # between two held bounds: said so
    with pytest.raises(GrammarError, match="widen it") as err:
        rewrite_schema(narrow, FORMATS)
    assert err.value.kind == "unsupported" and str(2**53 + 1) in str(err.value)


def test_spec_key_is_canonical() -> None:
    a = ConstraintSpec("json_schema", {"b": 1, "a": {"y": 2, "x": 1}})
    b = ConstraintSpec("json_schema", '{"a": {"x": 1, "y": 2}, "b": 1}')
    assert a.key == b.key
    assert ConstraintSpec("choice", ["a", "b"]).key != ConstraintSpec("choice", ["b", "a"]).key


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.text(alphabet="ab\n.", min_size=0, max_size=4), min_size=1, max_size=4),
    st.lists(st.text(alphabet="ab\n.c", max_size=5), max_size=12),
)
def test_complement_regex_matches_everything_else(words: list[str], probes: list[str]) -> None:
    rx = re.compile(complement_regex(words))
    for s in probes + words:
        assert (rx.fullmatch(s) is not None) == (s not in words)


@pytest.mark.parametrize("pattern", ["^[a-c]+$", "^[a-c]*$", "^[^a]+$"])
def test_negated_class_patterns(pattern: str) -> None:
    neg = re.compile(negate_pattern(pattern))
    for s in ["", "a", "abc", "abd", "d", "dd", "a\nb"]:
        assert (re.search(pattern, s) is None) == (neg.search(s) is not None), s
