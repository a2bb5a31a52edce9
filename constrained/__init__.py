"""Grammar-constrained decoding: JSON schema, any JSON object, regex, a list of choices, or a context-free grammar.

One interface, llguidance as the backend (the one that rejects what it cannot enforce instead of ignoring it);
see docs/constrained.md. Typical use by the engine:

    info = TokenizerInfo.from_hf(tokenizer, vocab_size=config.vocab_size, eos_token_ids=eos_ids)
    compiler = GrammarCompiler(info)                                  # once per model
    grammar = compiler.submit(ConstraintSpec("json_schema", schema)).result()   # off the hot path
    matcher = grammar.new_matcher()                                   # per request
    bitmask = allocate_bitmask(batch, info.vocab_size)                # per step: all ones
    fill_bitmasks([(matcher, row)], bitmask)                          # constrained rows only
    apply_bitmask(logits, bitmask)                                    # one vectorized op
    matcher.accept_token(token); matcher.is_terminated(); matcher.forced_tokens()
"""

from typing import Any

from radixserve.constrained.spec import ConstraintKind, ConstraintSpec, GrammarError

# The rest is imported on first use: the HTTP front end of an engine process needs only the spec and its error,
# and must not pay for torch and llguidance (seconds at start-up) to get them.
_LAZY = {
    "CompiledGrammar": "radixserve.constrained.backend",
    "GrammarBackend": "radixserve.constrained.backend",
    "LLGuidanceBackend": "radixserve.constrained.backend",
    "Matcher": "radixserve.constrained.backend",
    "allocate_bitmask": "radixserve.constrained.bitmask",
    "apply_bitmask": "radixserve.constrained.bitmask",
    "bitmask_to_bool": "radixserve.constrained.bitmask",
    "fill_bitmasks": "radixserve.constrained.bitmask",
    "GrammarCompiler": "radixserve.constrained.compiler",
    "TokenizerError": "radixserve.constrained.tokenizer",
    "TokenizerInfo": "radixserve.constrained.tokenizer",
}

__all__ = ["ConstraintKind", "ConstraintSpec", "GrammarError", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'constrained' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
