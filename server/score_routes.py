"""Scoring with an embedding model (``--runner pooling``): vLLM's ``/score`` and the Jina/Cohere ``/rerank`` shape.

A score is the cosine similarity of two texts' embeddings (vLLM's score for embedding models). Every text is
embedded once, however many pairs it is in, and all of a call's texts are batched (``openai_embeddings``): a query
scored against a hundred documents is one query prefill, and texts that share a head (an instruction) share its
cached KV.

* ``POST /score`` and ``/v1/score``: ``text_1`` and ``text_2`` (each a text or a list of texts): one text against
  each of a list, or two lists of the same length pair by pair; ``data`` holds one ``score`` per pair.
* ``POST /rerank``, ``/v1/rerank`` and ``/v2/rerank``: ``query`` and ``documents``; ``results`` lists the
  documents by falling ``relevance_score``, the first ``top_n`` of them (all by default), each with its ``index``
  and (``return_documents``, default true) its text.
* ``POST /classify`` and ``/v1/classify`` (vLLM's): a classifier's output probabilities per input, and its label.

On a server of a classifier (a cross-encoder reranker: ``server.cross_encoder``) a score is the classifier's
output for the pair's prompt instead, and vLLM's ``instruction``, ``chat_template_kwargs``, ``use_activation``,
``max_tokens_per_query`` and ``max_tokens_per_doc`` apply.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import AliasChoices, Field

from radixserve.server.cross_encoder import cross_scores
from radixserve.server.deps import StateDep, require_api_key
from radixserve.server.errors import bad_request
from radixserve.server.extra_fields import check_extra_fields
from radixserve.server.openai_embeddings import (
    MAX_INPUTS,
    embed,
    embed_texts,
    fit_prompts,
    pooling_inputs,
    served_pooling,
    vector_of,
)
from radixserve.server.protocol import PoolingInput, _NullIsDefault

router = APIRouter(dependencies=[Depends(require_api_key)], tags=["Scores"])


class _ScoreOptions(_NullIsDefault):
    model: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    priority: int | None = None
    user: str | None = None
    # Cross-encoders only (server.cross_encoder):
    use_activation: bool | None = Field(
        None,
        validation_alias=AliasChoices("use_activation", "activation"),  # (vLLM's name for it before 0.11)
        description="Scores through the classifier's activation (default).",
    )
    instruction: str | None = Field(None, description="The score template's `instruction` variable.")
    chat_template_kwargs: dict[str, Any] | None = None
    max_tokens_per_query: int = Field(0, ge=0, description="Cut each query to this many tokens (0: whole).")
    max_tokens_per_doc: int = Field(0, ge=0, description="Cut each document to this many tokens (0: whole).")


class ScoreRequest(_ScoreOptions):
    """The texts as ``text_1``/``text_2``, or vLLM's other names for them: ``queries`` with ``documents`` or
    ``items``, ``data_1``/``data_2``."""

    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    items: str | list[str] | None = None
    data_1: str | list[str] | None = None
    data_2: str | list[str] | None = None

    def sides(self) -> tuple[str | list[str], str | list[str]]:
        given = [
            (first, second)
            for first, second in (
                (self.text_1, self.text_2),
                (self.queries, self.documents),
                (self.queries, self.items),
                (self.data_1, self.data_2),
            )
            if first is not None and second is not None
        ]
        if len(given) != 1:
            raise bad_request(
                "give the texts as text_1 and text_2 (or queries and documents, queries and items, data_1 and data_2)",
                "text_1",
            )
        return given[0]


class RerankDocument(_NullIsDefault):
    text: str


class RerankRequest(_ScoreOptions):
    query: str
    documents: list[str | RerankDocument]  # (Cohere's v1 and Jina's clients may send {"text": ...} objects)
    top_n: int | None = Field(None, ge=0, description="How many of the best documents to return (0 or none: all).")
    return_documents: bool = True


class ClassifyRequest(PoolingInput):
    model: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    use_activation: bool | None = Field(
        None,
        validation_alias=AliasChoices("use_activation", "activation"),
        description="Probabilities through the activation (default).",
    )
    priority: int | None = None
    user: str | None = None


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
    return dot / norm if norm > 0 else 0.0


def _usage(results: list[Any]) -> dict[str, Any]:
    tokens = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    return {"prompt_tokens": tokens, "total_tokens": tokens, "prompt_tokens_details": {"cached_tokens": cached}}


async def _scores(
    state: Any, request: Request, model: str | None, queries: list[str], docs: list[str], options: Any, param: str
) -> tuple[list[float], dict[str, Any], str]:
    """The scores of ``queries[i]`` with ``docs[i]`` (a classifier's, or embeddings' cosine similarities), the
    usage (the prompt tokens computed, how many came from the cache) and the served name."""
    engine = state.ready_engine()
    if engine.pooling is not None and engine.pooling.labels is not None:
        scores, results, served = await cross_scores(state, request, model, queries, docs, options)
        return scores, _usage(results), served
    if engine.pooling is not None and (
        options.instruction is not None
        or options.chat_template_kwargs
        or options.max_tokens_per_query
        or options.max_tokens_per_doc
    ):
        raise bad_request(
            "instruction, chat_template_kwargs and max_tokens_per_query/doc apply to cross-encoder rerankers; this "
            "server scores with embeddings",
            "instruction",
        )
    # Each distinct text is embedded once.
    texts = list(dict.fromkeys([*queries, *docs]))
    if len(texts) > MAX_INPUTS:
        raise bad_request(f"{len(texts)} distinct texts; at most {MAX_INPUTS} per request", param)
    vectors, results, served = await embed_texts(
        state, request, model, texts, options.truncate_prompt_tokens, options.priority, param
    )
    at = {text: vectors[k] for k, text in enumerate(texts)}
    scores = [_cosine(at[q], at[d]) for q, d in zip(queries, docs)]
    return scores, _usage(results), served


@router.post("/score", include_in_schema=False)
@router.post("/v1/score", summary="Score text pairs: a cross-encoder's score, or embeddings' cosine (vLLM's)")
async def score(body: ScoreRequest, request: Request, state: StateDep):
    check_extra_fields(body, "/v1/score")
    text_1, text_2 = body.sides()
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise bad_request("text_1 and text_2 must each hold at least one text", "text_1" if not first else "text_2")
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise bad_request(
            f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many as text_2", "text_1"
        )
    if len(first) > MAX_INPUTS:
        raise bad_request(f"{len(first)} pairs; at most {MAX_INPUTS} per request", "text_2")
    scores, usage, served = await _scores(state, request, body.model, first, second, body, "text_2")
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": served,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": usage,
    }


@router.post("/rerank", include_in_schema=False)
@router.post("/v2/rerank", include_in_schema=False)
@router.post("/v1/rerank", summary="Rank documents by their relevance to a query (Jina's and Cohere's shape)")
async def rerank(body: RerankRequest, request: Request, state: StateDep):
    check_extra_fields(body, "/v1/rerank")
    if not body.documents:
        raise bad_request("documents must hold at least one text", "documents")
    if len(body.documents) > MAX_INPUTS:
        raise bad_request(f"{len(body.documents)} documents; at most {MAX_INPUTS} per request", "documents")
    docs = [d if isinstance(d, str) else d.text for d in body.documents]
    queries = [body.query] * len(docs)
    scores, usage, served = await _scores(state, request, body.model, queries, docs, body, "documents")
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if body.top_n:
        order = order[: body.top_n]
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            item["document"] = {"text": docs[i]}
        results.append(item)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": served, "usage": usage, "results": results}


@router.post("/classify", include_in_schema=False)
@router.post("/v1/classify", summary="Classify texts with a classifier model (vLLM's)")
async def classify(body: ClassifyRequest, request: Request, state: StateDep):
    check_extra_fields(body, "/v1/classify")
    engine = state.ready_engine()
    pooling = served_pooling(engine, classifier=True)
    lora = state.check_model(body.model)
    prompts = fit_prompts(await pooling_inputs(body, state), body.truncate_prompt_tokens, engine, "input")
    results = await embed(state, request, prompts, pooling.default, lora, body.priority, None)
    data = []
    for k, res in enumerate(results):
        logits = vector_of(res)
        probs = pooling.activate(logits) if body.use_activation is not False else logits
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": k, "label": pooling.labels[best], "probs": probs, "num_classes": len(probs)})
    return {
        "id": f"classify-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": lora or state.served_name,
        "data": data,
        "usage": {**_usage(results), "completion_tokens": 0},
    }
