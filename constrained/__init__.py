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

from constrained.backend import CompiledGrammar, GrammarBackend, LLGuidanceBackend, Matcher
from constrained.bitmask import allocate_bitmask, apply_bitmask, bitmask_to_bool, fill_bitmasks
from constrained.compiler import GrammarCompiler
from constrained.spec import ConstraintKind, ConstraintSpec, GrammarError
from constrained.tokenizer import TokenizerError, TokenizerInfo

__all__ = [
    "CompiledGrammar",
    "ConstraintKind",
    "ConstraintSpec",
    "GrammarBackend",
    "GrammarCompiler",
    "GrammarError",
    "LLGuidanceBackend",
    "Matcher",
    "TokenizerError",
    "TokenizerInfo",
    "allocate_bitmask",
    "apply_bitmask",
    "bitmask_to_bool",
    "fill_bitmasks",
]
