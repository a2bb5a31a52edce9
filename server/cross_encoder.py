"""Scores from a classifier (``--runner pooling`` on a cross-encoder reranker): each (query, document) pair is one
prompt, and its score is the classifier's activated output at the prompt's end (``runtime.pooling``).

A pair's prompt, as vLLM builds it for decoder rerankers:

* with ``--chat-template``: the template rendered over two messages, ``{"role": "query"}`` then
  ``{"role": "document"}``, with the request's ``chat_template_kwargs`` (and ``instruction``, which is
  ``chat_template_kwargs["instruction"]``) as template variables;
* without: the query's text followed by the document's.

Either way the query comes first, so the pairs of one query share their head: the first pair's prefill leaves it
in the radix cache and every other pair computes its document only (``usage`` counts every prompt token, and
``prompt_tokens_details.cached_tokens`` says how many came from the cache).
"""

from __future__ import annotations

from typing import Any

from fastapi import Request

from radixserve.server.chat import RESERVED_TEMPLATE_KWARGS
from radixserve.server.errors import APIError, bad_request
from radixserve.server.openai_embeddings import embed, fit_prompts, vector_of
from radixserve.server.state import ServerState
from radixserve.server.tokens import encode, item_ids


def classifier(engine: Any) -> Any:
    """The served classifier (``PoolingModel`` with labels), or a 400 naming what this server serves instead."""
    pooling = engine.pooling
    if pooling is None or pooling.labels is None:
        served = "generates text" if pooling is None else "serves embeddings"
        raise APIError(
            400,
            f"this server {served}; classification needs a classifier (a *ForSequenceClassification model, or "
            "classifier_from_token in --hf-overrides) served with --runner pooling",
            param="model",
            code="model_not_supported",
        )
    return pooling


def _shorten(tokenizer: Any, text: str, limit: int) -> str:
    """``text`` cut to its first ``limit`` tokens (vLLM's ``max_tokens_per_query`` / ``max_tokens_per_doc``)."""
    if limit <= 0:
        return text
    ids = encode(tokenizer, text, add_special_tokens=False)
    return text if len(ids) <= limit else tokenizer.decode(ids[:limit])


def pair_texts(state: ServerState, queries: list[str], docs: list[str], options: Any) -> list[str]:
    """Each pair's prompt text (the module's docstring)."""
    tokenizer = state.ready_engine().tokenizer
    kwargs = dict(options.chat_template_kwargs or {})
    if options.instruction is not None:
        kwargs.setdefault("instruction", options.instruction)
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    short_q = {q: _shorten(tokenizer, q, options.max_tokens_per_query) for q in set(queries)}
    short_d = {d: _shorten(tokenizer, d, options.max_tokens_per_doc) for d in set(docs)}
    texts = []
    for q, d in zip(queries, docs):
        query, doc = short_q[q], short_d[d]
        if state.chat_template is None:
            texts.append(query + doc)
            continue
        messages = [{"role": "query", "content": query}, {"role": "document", "content": doc}]
        try:
            texts.append(tokenizer.apply_chat_template(messages, chat_template=state.chat_template, tokenize=False,
                                                       **kwargs))  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - Jinja errors (incl. a template's raise_exception) are the client's
            raise bad_request(f"the score template (--chat-template) failed on this pair: {exc}", "documents") from None
    return texts


async def cross_scores(
    state: ServerState, request: Request, model: str | None, queries: list[str], docs: list[str], options: Any
) -> tuple[list[float], list[Any], str]:
    """Each pair's score (one output, activated unless ``options.use_activation`` is false), the pairs' results
    and the name served."""
    engine = state.ready_engine()
    pooling = classifier(engine)
    if len(pooling.labels) != 1:
        raise APIError(
            400,
            f"scores need a classifier of one output; this model has {len(pooling.labels)} "
            f"({', '.join(pooling.labels)}): use /classify",
            param="model",
            code="model_not_supported",
        )
    lora = state.check_model(model)
    texts = pair_texts(state, queries, docs, options)
    prompts = [item_ids(t, k, engine.tokenizer, engine.vocab_size, True, "documents") for k, t in enumerate(texts)]
    prompts = fit_prompts(prompts, options.truncate_prompt_tokens, engine, "documents")
    results = await embed(state, request, prompts, pooling.default, lora, options.priority, None)
    activate = options.use_activation is not False
    scores = [(pooling.activate(vector_of(r)) if activate else vector_of(r))[0] for r in results]
    return scores, results, lora or state.served_name
