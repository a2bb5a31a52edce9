"""Scores from a classifier (``--runner pooling`` on a cross-encoder reranker): each (query, document) pair is one
prompt, and its score is the classifier's activated output at the prompt's end (``runtime.pooling``).

A pair's prompt, as vLLM builds it for decoder rerankers:

* with ``--chat-template``: the template rendered over two messages, ``{"role": "query"}`` then
  ``{"role": "document"}``, with the request's ``chat_template_kwargs`` (and ``instruction``, which is
  ``chat_template_kwargs["instruction"]``) as template variables;
* without: the query's text followed by the document's.

Either way the query comes first, so the pairs of one query share their head: the scheduler computes it for one
pair and holds the others a step (``runtime.scheduler``: a pooling request always waits for a shared head), and
they take it from the radix cache (``usage.prompt_tokens_details.cached_tokens``). A pair longer
than ``truncate_prompt_tokens`` (or the context) loses the end of its document, never the query or the template:
cutting either would score the document against nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request

from radixserve.server.chat import RESERVED_TEMPLATE_KWARGS
from radixserve.server.errors import APIError, bad_request
from radixserve.server.openai_embeddings import embed, served_pooling, vector_of
from radixserve.server.state import ServerState
from radixserve.server.tokens import encode

# Attempts at fitting a pair by cutting its document (a cut can change how the text around it tokenizes).
_FIT_TRIES = 4


def _shorten(tokenizer: Any, text: str, limit: int) -> str:
    """``text`` cut to its first ``limit`` tokens (vLLM's ``max_tokens_per_query`` / ``max_tokens_per_doc``),
    without the half of a character a cut inside it leaves."""
    if limit <= 0:
        return text
    ids = encode(tokenizer, text, add_special_tokens=False)
    if len(ids) <= limit:
        return text
    return tokenizer.decode(ids[:limit], clean_up_tokenization_spaces=False).rstrip("\ufffd")


class PairPrompts:
    """Makes the pairs' token ids (the module's docstring), on the tokenizer's side of the event loop."""

    def __init__(self, state: ServerState, options: Any) -> None:
        engine = state.ready_engine()
        self.tokenizer, self.vocab_size = engine.tokenizer, engine.vocab_size
        self.template = state.chat_template
        self.options = options
        self.kwargs = dict(options.chat_template_kwargs or {})
        if options.instruction is not None:
            self.kwargs.setdefault("instruction", options.instruction)
        if self.kwargs and self.template is None:
            raise bad_request(
                "instruction and chat_template_kwargs fill the score template; this server has none (start it with "
                "--chat-template FILE)",
                "instruction" if options.instruction is not None else "chat_template_kwargs",
            )
        reserved = sorted(set(self.kwargs) & (RESERVED_TEMPLATE_KWARGS | {"return_dict"}))
        if reserved:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
        keep = options.truncate_prompt_tokens
        if keep is not None and keep < 1 and keep != -1:
            raise bad_request("truncate_prompt_tokens must be >= 1, or -1 for as many as fit", "truncate_prompt_tokens")
        self.limit = engine.max_context_len if keep in (None, -1) else min(keep, engine.max_context_len)

    def text(self, query: str, doc: str) -> str:
        if self.template is None:
            return query + doc
        messages = [{"role": "query", "content": query}, {"role": "document", "content": doc}]
        try:
            text = self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                      **self.kwargs)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - Jinja errors (incl. a template's raise_exception) are the client's
            raise bad_request(f"the score template (--chat-template) failed on this pair: {exc}", "documents") from None
        if not isinstance(text, str):
            raise bad_request("the score template did not render to text", "chat_template_kwargs")
        return text

    def ids(self, query: str, doc: str) -> list[int]:
        """The pair's token ids, its document cut until they fit ``truncate_prompt_tokens`` (or the context)."""
        ids = encode(self.tokenizer, self.text(query, doc), add_special_tokens=True)
        for _ in range(_FIT_TRIES):
            if len(ids) <= self.limit:
                break
            keep = len(encode(self.tokenizer, doc, add_special_tokens=False)) - (len(ids) - self.limit)
            if keep < 1:
                raise bad_request(
                    f"the query and the template alone take more than the {self.limit} tokens a pair may have "
                    "(truncate_prompt_tokens, or the context); shorten the query (max_tokens_per_query)",
                    "query",
                )
            doc = _shorten(self.tokenizer, doc, keep)
            ids = encode(self.tokenizer, self.text(query, doc), add_special_tokens=True)
        if len(ids) > self.limit:
            raise bad_request(f"a pair does not fit in {self.limit} tokens even with its document cut", "documents")
        if not ids:
            raise bad_request("a pair's prompt is empty", "documents")
        return ids

    def all(self, queries: list[str], docs: list[str]) -> list[list[int]]:
        opts = self.options
        short_q = {q: _shorten(self.tokenizer, q, opts.max_tokens_per_query) for q in set(queries)}
        short_d = {d: _shorten(self.tokenizer, d, opts.max_tokens_per_doc) for d in set(docs)}
        return [self.ids(short_q[q], short_d[d]) for q, d in zip(queries, docs)]


async def cross_scores(
    state: ServerState, request: Request, model: str | None, queries: list[str], docs: list[str], options: Any
) -> tuple[list[float], list[Any], str]:
    """Each pair's score (one output, activated unless ``options.use_activation`` is false), the pairs' results
    and the name served."""
    engine = state.ready_engine()
    pooling = served_pooling(engine, classifier=True)
    if len(pooling.labels) != 1:
        raise APIError(
            400,
            f"scores need a classifier of one output; this model has {len(pooling.labels)} "
            f"({', '.join(pooling.labels)}): use /v1/classify",
            param="model",
            code="model_not_supported",
        )
    lora = state.check_model(model)
    # Rendering and tokenizing thousands of pairs takes a while: off the event loop.
    prompts = await asyncio.to_thread(PairPrompts(state, options).all, queries, docs)
    results = await embed(state, request, prompts, pooling.default, lora, options.priority, None)
    activate = options.use_activation is not False
    scores = [(pooling.activate(vector_of(r)) if activate else vector_of(r))[0] for r in results]
    return scores, results, lora or state.served_name
