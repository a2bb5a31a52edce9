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
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import Field

from radixserve.server.deps import StateDep, require_api_key
from radixserve.server.errors import bad_request
from radixserve.server.extra_fields import check_extra_fields
from radixserve.server.openai_embeddings import MAX_INPUTS, embed_texts
from radixserve.server.protocol import _NullIsDefault

router = APIRouter(dependencies=[Depends(require_api_key)], tags=["Scores"])


class ScoreRequest(_NullIsDefault):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    priority: int | None = None


class RerankRequest(_NullIsDefault):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = Field(None, ge=0, description="How many of the best documents to return (0 or none: all).")
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    priority: int | None = None


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
    return dot / norm if norm > 0 else 0.0


async def _scores(
    state: Any, request: Request, model: str | None, queries: list[str], docs: list[str], options: Any, param: str
) -> tuple[list[float], int, str]:
    """Cosine similarities of ``queries[i]`` and ``docs[i]``, the prompt tokens embedded, and the served name.
    Each distinct text is embedded once."""
    texts = list(dict.fromkeys([*queries, *docs]))
    if len(texts) > MAX_INPUTS:
        raise bad_request(f"{len(texts)} distinct texts; at most {MAX_INPUTS} per request", param)
    vectors, results, served = await embed_texts(
        state, request, model, texts, options.truncate_prompt_tokens, options.priority, param
    )
    at = {text: vectors[k] for k, text in enumerate(texts)}
    scores = [_cosine(at[q], at[d]) for q, d in zip(queries, docs)]
    return scores, sum(r.prompt_tokens for r in results), served


@router.post("/score", include_in_schema=False)
@router.post("/v1/score", summary="Score text pairs by their embeddings' cosine similarity (vLLM's)")
async def score(body: ScoreRequest, request: Request, state: StateDep):
    check_extra_fields(body, "/v1/score")
    first = [body.text_1] if isinstance(body.text_1, str) else list(body.text_1)
    second = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
    if not first or not second:
        raise bad_request("text_1 and text_2 must each hold at least one text", "text_1" if not first else "text_2")
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise bad_request(
            f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many as text_2", "text_1"
        )
    scores, tokens, served = await _scores(state, request, body.model, first, second, body, "text_2")
    return {
        "id": f"score-{uuid.uuid4().hex}",
        "object": "list",
        "created": int(time.time()),
        "model": served,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


@router.post("/rerank", include_in_schema=False)
@router.post("/v2/rerank", include_in_schema=False)
@router.post("/v1/rerank", summary="Rank documents by their relevance to a query (Jina's and Cohere's shape)")
async def rerank(body: RerankRequest, request: Request, state: StateDep):
    check_extra_fields(body, "/v1/rerank")
    if not body.documents:
        raise bad_request("documents must hold at least one text", "documents")
    queries = [body.query] * len(body.documents)
    scores, tokens, served = await _scores(state, request, body.model, queries, body.documents, body, "documents")
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if body.top_n:
        order = order[: body.top_n]
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            item["document"] = {"text": body.documents[i]}
        results.append(item)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": served, "usage": {"total_tokens": tokens}, "results": results}
