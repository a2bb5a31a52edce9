"""Constrained decoding with the real SmolLM2 tokenizer: vocabulary, masks, EOS, jump-forward, rollback, compile errors
(the compiler's pool: test_grammar_compiler.py)."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from radixserve.constrained import (
    ConstraintSpec,
    GrammarCompiler,
    GrammarError,
    TokenizerInfo,
    allocate_bitmask,
    apply_bitmask,
    bitmask_to_bool,
    fill_bitmasks,
)
from radixserve.constrained.backend import LLGuidanceBackend
from radixserve.constrained.regex_check import forced_run

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    from radixserve.runtime.model_source import resolve_model
    from radixserve.runtime.weights import load_tokenizer

    return load_tokenizer(resolve_model("smollm2-135m-instruct"))


@pytest.fixture(scope="module")
def info(tokenizer) -> TokenizerInfo:
    return TokenizerInfo.from_hf(tokenizer)


@pytest.fixture(scope="module")
def compiler(info):
    c = GrammarCompiler(info, timeout_s=10.0)
    yield c
    c.close()


def allowed(matcher, info) -> torch.Tensor:
    bm = allocate_bitmask(1, info.vocab_size)
    matcher.fill_bitmask(bm, 0)
    return bitmask_to_bool(bm, info.vocab_size)[0]


def encode(info, text: str) -> list[int]:
    return info.ll_tokenizer.tokenize_str(text)


def test_vocabulary_is_raw_bytes_without_special_tokens(tokenizer, info) -> None:
    assert info.vocab_size == len(info.token_bytes) == 49152
    assert info.eos_token_ids == (tokenizer.eos_token_id,)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert im_start in info.special_ids and info.token_bytes[im_start] == b""
    space_the = tokenizer.convert_tokens_to_ids("Ġthe")
    assert info.token_bytes[space_the] == b" the"
    assert TokenizerInfo.from_hf(tokenizer) is info  # cached per tokenizer
    padded = TokenizerInfo.from_hf(tokenizer, vocab_size=49216)
    assert padded.vocab_size == 49216 and 49200 in padded.special_ids


@pytest.mark.parametrize(
    "spec, text",
    [
        (ConstraintSpec("json_schema", PERSON), '{"name":"Ann","age":31,"role":"user"}'),
        (ConstraintSpec("json_object"), '{"a":[1,{"b":null}]}'),
        (ConstraintSpec("regex", r"\d{3}-[a-z]+"), "123-abc"),
        (ConstraintSpec("choice", ["yes", "no", "maybe so"]), "maybe so"),
        (ConstraintSpec("grammar", 'start: "(" start ")" | "x"'), "((x))"),
        (ConstraintSpec("grammar", 'root ::= "a" root | "b"'), "aab"),
    ],
)
def test_each_kind_compiles_and_accepts_a_valid_output(compiler, info, spec, text) -> None:
    matcher = compiler.compile(spec).new_matcher()
    for tok in encode(info, text):
        assert allowed(matcher, info)[tok]
        assert matcher.accept_token(tok)
    assert matcher.can_terminate()


def test_walk_json_instance_and_reject_invalid(compiler, info) -> None:
    grammar = compiler.compile(ConstraintSpec("json_schema", PERSON))
    eos = info.eos_token_ids[0]
    matcher = grammar.new_matcher()
    toks = encode(info, '{"name":"Ann","age":31,"role":"admin"}')
    for tok in toks:
        mask = allowed(matcher, info)
        assert mask[tok] and not mask[eos], "EOS is allowed only where the grammar may end"
        assert matcher.accept_token(tok)
    assert matcher.is_terminated() and allowed(matcher, info).nonzero().flatten().tolist() == [eos]

    for bad in ['{"name":"Ann","age":151', '{"name":"Ann","age":3,"role":"root"}', '{"nam']:
        matcher = grammar.new_matcher()
        results = [matcher.accept_token(t) for t in encode(info, bad)]
        if bad == '{"nam':
            assert all(results) and not matcher.can_terminate()
        else:
            assert not all(results)
    matcher = grammar.new_matcher()
    before = allowed(matcher, info)
    assert not matcher.accept_token(encode(info, "[")[0])
    assert torch.equal(allowed(matcher, info), before), "a rejected token leaves the state unchanged"


def test_mask_is_exactly_the_accepted_tokens(compiler, info) -> None:
    grammar = compiler.compile(ConstraintSpec("choice", ["alpha", "alps", "beta"]))
    matcher = grammar.new_matcher()
    mask = allowed(matcher, info)
    brute = torch.zeros_like(mask)
    for tok in range(info.vocab_size):
        probe = grammar.new_matcher()
        brute[tok] = probe.accept_token(tok)
    assert torch.equal(mask, brute)
    texts = [info.token_bytes[t] for t in mask.nonzero().flatten().tolist()]
    assert b"a" in texts and all(any(w.startswith(t) for w in (b"alpha", b"alps", b"beta")) for t in texts)


def test_special_tokens_never_allowed_inside_json_strings(compiler, info) -> None:
    matcher = compiler.compile(ConstraintSpec("json_schema", {"type": "string"})).new_matcher()
    special = torch.tensor(sorted(info.special_ids))
    for tok in encode(info, '"hello <|im_end|> world'):  # literal text, spelled with ordinary tokens
        assert not allowed(matcher, info)[special].any()
        assert matcher.accept_token(tok)
    const = {"type": "object", "properties": {"k": {"const": "<|im_end|> x"}}, "required": ["k"]}
    forced = compiler.compile(ConstraintSpec("json_schema", const)).new_matcher().forced_tokens()
    assert forced and not set(forced) & info.special_ids


def test_forced_tokens_are_canonical_and_back_off_at_the_boundary(compiler, info, tokenizer) -> None:
    matcher = compiler.compile(ConstraintSpec("json_schema", PERSON)).new_matcher()
    forced = matcher.forced_tokens()
    assert tokenizer.decode(forced) == '{"name'  # '":"' may merge with the value's first characters
    assert forced == encode(info, '{"name')
    for tok in forced:
        assert matcher.accept_token(tok)
    for tok in encode(info, '":"Bo","'):
        assert matcher.accept_token(tok)
    assert tokenizer.decode(matcher.forced_tokens()).startswith("age")
    done = compiler.compile(ConstraintSpec("choice", ["only"])).new_matcher()
    assert tokenizer.decode(done.forced_tokens()) in ("only", "onl", "on", "o")


def test_rollback(compiler, info) -> None:
    matcher = compiler.compile(ConstraintSpec("json_schema", PERSON)).new_matcher()
    toks = encode(info, '{"name":"Ann","age":31')
    masks = []
    for tok in toks:
        masks.append(allowed(matcher, info))
        assert matcher.accept_token(tok)
    matcher.rollback(3)
    assert matcher.num_tokens == len(toks) - 3
    assert torch.equal(allowed(matcher, info), masks[-3])
    with pytest.raises(ValueError):
        matcher.rollback(len(toks))
    matcher.rollback(matcher.num_tokens)
    assert torch.equal(allowed(matcher, info), masks[0])


def test_cache_hits_and_canonical_keys(compiler) -> None:
    first = compiler.compile(ConstraintSpec("json_schema", {"type": "object", "properties": {"x": {}, "y": {}}}))
    hits = compiler.stats.hits
    again = compiler.submit(ConstraintSpec("json_schema", '{"properties": {"y": {}, "x": {}}, "type": "object"}'))
    assert again.done() and again.result() is first and compiler.stats.hits == hits + 1


def test_errors_name_the_problem(compiler) -> None:
    with pytest.raises(GrammarError, match="invalid regex"):
        compiler.compile(ConstraintSpec("regex", "[0-9]+("))
    with pytest.raises(GrammarError) as err:
        compiler.compile(ConstraintSpec("json_schema", {"properties": {"t": {"type": "array", "uniqueItems": True}}}))
    assert (err.value.kind, err.value.keyword, err.value.pointer) == ("unsupported", "uniqueItems", "/properties/t")
    with pytest.raises(GrammarError) as err:
        compiler.compile(ConstraintSpec("json_schema", {"properties": {"a": {"pattern": "(?=x)a"}}}))
    assert err.value.pointer == "/properties/a/pattern"
    with pytest.raises(GrammarError, match="invalid JSON schema at /type"):
        compiler.compile(ConstraintSpec("json_schema", {"type": "strin"}))
    with pytest.raises(GrammarError, match="invalid grammar"):
        compiler.compile(ConstraintSpec("grammar", "start: undefined_rule"))
    failed = compiler.submit(ConstraintSpec("choice", []))
    assert failed.done() and isinstance(failed.exception(), GrammarError)


@pytest.mark.parametrize(
    ("spec", "kind", "why"),
    [
        (ConstraintSpec("grammar", "start: start"), "invalid", "admits no output"),
        (ConstraintSpec("grammar", 'start: a\na: a "x"'), "invalid", "admits no output"),
        (ConstraintSpec("json_schema", {"$ref": "#"}), "invalid", "admits no output"),
        # Python cannot parse \p{L}, so no static check stops this one: the backend's limits do.
        (ConstraintSpec("regex", r"\p{L}(a{1000}){1000}"), "too_complex", "too many expressions"),
    ],
)
def test_grammars_that_cannot_be_served_are_refused_at_compile_time(compiler, spec, kind, why) -> None:
    """Without the compile-time probe these compiled: the first two ended at once with empty output, the last
    stalled the engine loop for its first mask and then failed on the first token."""
    with pytest.raises(GrammarError, match=why) as err:
        compiler.compile(spec)
    assert err.value.kind == kind


@pytest.mark.parametrize(
    "spec",
    [
        ConstraintSpec("regex", "(a{1000}){1000}"),
        ConstraintSpec("regex", "x(b{600}){600}|y"),
        ConstraintSpec("json_schema", {"properties": {"a/b": {"type": "string", "pattern": "^(x{300}){300}$"}}}),
        ConstraintSpec("json_schema", {"type": "object", "patternProperties": {"^k{99999}$": {"type": "integer"}}}),
    ],
)
def test_regexes_forcing_huge_stretches_are_refused_before_compiling(info, spec) -> None:
    """Nested counts multiply; a regex that forces too long a stretch is refused when submitted, without costing
    a compile worker (these took ~1 s of lexer work each). The error names the JSON pointer of a schema's pattern."""
    release = threading.Event()

    class Blocking:  # every compile waits: only a refusal at submit can finish the future at once
        name = "blocking"

        def compile(self, spec):
            release.wait(30)
            raise AssertionError("compiled")

    compiler = GrammarCompiler(info, max_workers=1, backend=Blocking())
    try:
        failed = compiler.submit(spec)
        assert failed.done(), "refused at submit, not queued for a worker"
        assert failed.exception().kind == "too_complex" and "forces a stretch" in str(failed.exception())
        if spec.kind == "json_schema" and "properties" in spec.value:
            assert "/properties/a~1b/pattern" in str(failed.exception())
    finally:
        release.set()
        compiler.close()


@pytest.mark.parametrize(
    ("pattern", "run"),
    [
        ("(b{600}){600}", 360_000),
        ("x(b{600}){600}|y", 360_001),
        ("a{3000}(a{3000}[xy])", 6_000),  # a group's forced head joins the run before it
        ("(ab[xy]cd){3}", 4),  # one copy's tail runs into the next copy's head
        ("(a{600}){0,600}", 600),  # optional copies are not forced, the inside of one is
        ("(a{0,600}){600}", 1),
        ("[ab]{300000}", 0),  # a class is a choice at every character: cheap however long
        (r"^(\d{1,3}\.){3}\d{1,3}$", 1),
        ("[0-9{x", None),  # Python cannot parse it: the backend reports the error
        ("(?i)x{40000}", 0),  # each cased letter is a choice of two
        ("(?i)1{40000}", 40_000),
        ("[[:alpha:]]{40000}", None),  # a class for Rust's regex, a literal "]" for Python's: no opinion
        ("ab{40000}|cd", 40_001),  # "a" picks the first branch
        ("a{40000}|a{20000}b", 0),  # both branches start with "a": only inner runs count (errs low)
    ],
)
def test_forced_run_is_the_longest_stretch_without_a_choice(pattern: str, run: int | None) -> None:
    assert forced_run(pattern) == run


def test_huge_number_bounds_compile_and_never_admit_more(compiler, info) -> None:
    """int64 ranges compiled only once their bounds moved inward; a bound between two doubles was rounded outward
    by the backend (9007199254740996 passed ``maximum: 9007199254740995``)."""

    def accepts(spec: ConstraintSpec, text: str) -> bool:
        matcher = compiler.compile(spec).new_matcher()
        return all(matcher.accept_token(t) for t in encode(info, text)) and matcher.can_terminate()

    int64 = ConstraintSpec("json_schema", {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1})
    assert accepts(int64, "0") and accepts(int64, "-9000000000000000000") and accepts(int64, "123456789012")
    assert not accepts(int64, "9223372036854775808") and not accepts(int64, "-9223372036854775809")
    odd = ConstraintSpec("json_schema", {"type": "integer", "maximum": 2**53 + 3})
    assert accepts(odd, str(2**53 - 2)) and not accepts(odd, str(2**53 + 4))
    # An exclusive bound that is a double was admitted itself; a number bound of 19 digits was read as 16.
    assert not accepts(ConstraintSpec("json_schema", {"type": "integer", "exclusiveMinimum": 2**54}), str(2**54))
    assert not accepts(ConstraintSpec("json_schema", {"type": "number", "maximum": 2**60}), str(2**60 + 1))
    # Values llguidance would write as another number are refused (it forced [1,36028797018963968] for this
    # const); numbers past 64 bits are a client error, not an internal one.
    with pytest.raises(GrammarError) as err:
        compiler.compile(ConstraintSpec("json_schema", {"properties": {"a": {"const": [1, 2**55 + 1]}}}))
    assert (err.value.kind, err.value.keyword, err.value.pointer) == ("unsupported", "const", "/properties/a/const")
    assert accepts(ConstraintSpec("json_schema", {"enum": [2**60, 1]}), str(2**60))  # a double: written exactly
    with pytest.raises(GrammarError) as err:
        compiler.compile(ConstraintSpec("json_schema", {"type": "integer", "minimum": 10**30}))
    assert err.value.kind == "too_complex"


def test_large_but_unforced_repetitions_stay_accepted(compiler) -> None:
    for pattern in ("[a-z]{0,100000}", "(ab|cd){20000}", "(a{600}){0,600}", "x{30000}"):
        assert compiler.compile(ConstraintSpec("regex", pattern)) is not None


def test_probe_keeps_grammars_that_end_at_once_or_recurse_with_a_base_case(compiler, info) -> None:
    maybe_empty = compiler.compile(ConstraintSpec("regex", "(ab)?")).new_matcher()
    assert allowed(maybe_empty, info).any() and maybe_empty.can_terminate()
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"]}
    matcher = compiler.compile(ConstraintSpec("json_schema", tree)).new_matcher()
    for token in encode(info, '{"kids":[{"kids":[]}]}'):
        assert matcher.accept_token(token)
    assert matcher.error() is None and matcher.is_terminated()


def test_spelled_special_token_in_a_constraint_is_text(compiler, info, tokenizer) -> None:
    """A constraint may spell ``<|im_end|>`` as text: it is written with text tokens, never the special token."""
    matcher = compiler.compile(ConstraintSpec("regex", r'\{"a":"<\|im_end\|>"\}')).new_matcher()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    written = []
    while not matcher.is_terminated():
        mask = allowed(matcher, info)
        assert not mask[end]
        forced = matcher.forced_tokens()
        token = forced[0] if forced else int(mask.nonzero()[0])
        assert matcher.accept_token(token)
        written.append(token)
    assert tokenizer.decode(written) == '{"a":"<|im_end|>"}'


def test_large_choice_lists_compile(compiler, info) -> None:
    choices = [f"label {i:05d}" for i in range(20000)]
    matcher = compiler.compile(ConstraintSpec("choice", choices)).new_matcher()
    for token in encode(info, "label 12345"):
        assert matcher.accept_token(token)
    assert matcher.is_terminated() or matcher.can_terminate()
    assert not matcher.accept_token(encode(info, "x")[0])


def test_apply_bitmask_on_a_batch(compiler, info) -> None:
    rows = [
        compiler.compile(ConstraintSpec("choice", ["yes", "no"])).new_matcher(),
        compiler.compile(ConstraintSpec("json_schema", PERSON)).new_matcher(),
    ]
    bitmask = allocate_bitmask(3, info.vocab_size)  # row 2 stays unconstrained
    fill_bitmasks([(rows[0], 0), (rows[1], 1)], bitmask)
    serial = allocate_bitmask(3, info.vocab_size)
    for i, m in enumerate(rows):
        m.fill_bitmask(serial, i)
    assert torch.equal(bitmask, serial)

    logits = torch.randn(3, info.vocab_size + 64)  # padded logit width
    expected = logits.clone()
    mask = bitmask_to_bool(bitmask, logits.shape[1])
    expected[~mask] = float("-inf")
    apply_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[:, info.vocab_size :]).all() and torch.isfinite(logits[2, : info.vocab_size]).all()
    assert int(torch.isfinite(logits[0]).sum()) == int(mask[0].sum()) > 0
    assert info.token_bytes[int(logits[1].argmax())] in (b"{", b'{"', b'{"name', b'{"n')


def test_bounded_whitespace_option(info) -> None:
    backend = LLGuidanceBackend(info, json_max_whitespace=2)
    grammar = backend.compile(ConstraintSpec("json_schema", PERSON))
    ok = grammar.new_matcher()
    assert all(ok.accept_token(t) for t in encode(info, json.dumps({"name": "A", "age": 1, "role": "user"}, indent=1)))
    assert ok.can_terminate()
    bad = grammar.new_matcher()
    assert not all(bad.accept_token(t) for t in encode(info, '{   "name"'))

