"""Jump-forward keeps greedy decoding unchanged: same tokens as decoding every token, in fewer forward passes.

Uses the real default model (HF ``transformers`` forward with a KV cache) to decode under a JSON schema twice:
once sampling every token, once appending ``forced_tokens()`` without a forward pass per token.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.constrained import ConstraintSpec, GrammarCompiler, TokenizerInfo, allocate_bitmask, apply_bitmask

pytestmark = pytest.mark.real_model

SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"done": {"type": "boolean"}, "priority": {"enum": ["low", "medium", "high"]}},
        "required": ["done", "priority"],
        "additionalProperties": False,
    },
]
# Many fixed keys with short values: the case for jump-forward (>= 30% fewer forward passes).
FIXED_KEYS = {
    "type": "object",
    "properties": {
        key: {"type": "integer", "minimum": 0, "maximum": 9}
        for key in ("customer_identifier", "shipping_priority", "warehouse_location", "payment_status_code",
                    "delivery_window_days", "loyalty_program_tier")
    },
    "required": ["customer_identifier", "shipping_priority", "warehouse_location", "payment_status_code",
                 "delivery_window_days", "loyalty_program_tier"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def setup(hf_smollm2):
    from radixserve.runtime.model_source import resolve_model
    from radixserve.runtime.weights import load_tokenizer

    folder = resolve_model("smollm2-135m-instruct")
    tokenizer = load_tokenizer(folder)
    model = hf_smollm2
    info = TokenizerInfo.from_hf(tokenizer, vocab_size=model.config.vocab_size)
    compiler = GrammarCompiler(info)
    yield tokenizer, model, info, compiler
    compiler.close()


def greedy(model, info, prompt: list[int], grammar, jump: bool, max_new: int = 48) -> tuple[list[int], int]:
    matcher = grammar.new_matcher()
    out: list[int] = []
    pending, past, passes = list(prompt), None, 0
    bitmask = allocate_bitmask(1, info.vocab_size)
    while len(out) < max_new and not matcher.is_terminated():
        if jump:
            forced = matcher.forced_tokens()
            assert all(matcher.accept_token(t) for t in forced)
            out += forced
            pending += forced
            if matcher.is_terminated():
                break
        with torch.no_grad():
            res = model(input_ids=torch.tensor([pending]), past_key_values=past, use_cache=True)
        past, passes = res.past_key_values, passes + 1
        logits = res.logits[:, -1, :].float()
        matcher.fill_bitmask(bitmask, 0)
        apply_bitmask(logits, bitmask)
        tok = int(logits.argmax(-1))
        if tok in info.eos_token_ids:
            break
        assert matcher.accept_token(tok)
        out.append(tok)
        pending = [tok]
    return out, passes


@pytest.mark.parametrize("schema", [*SCHEMAS, FIXED_KEYS])
def test_jump_forward_equals_plain_greedy(setup, schema) -> None:
    tokenizer, model, info, compiler = setup
    grammar = compiler.compile(ConstraintSpec("json_schema", schema))
    chat = [{"role": "user", "content": "Answer with one JSON object."}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    plain, plain_passes = greedy(model, info, prompt, grammar, jump=False)
    jumped, jump_passes = greedy(model, info, prompt, grammar, jump=True)
    assert jumped == plain, (tokenizer.decode(plain), tokenizer.decode(jumped))
    assert jump_passes < plain_passes
    if schema is FIXED_KEYS:
        print(f"forward passes: {plain_passes} plain, {jump_passes} with jump-forward")
        assert jump_passes <= 0.7 * plain_passes, (plain_passes, jump_passes)
