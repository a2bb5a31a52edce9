"""Cross-encoder rerankers and classifiers (``--runner pooling`` on a ``*ForSequenceClassification`` model, or a
language model read at two tokens as Qwen3-Reranker is): the outputs equal transformers' logits at float32, and
``/v1/score``, ``/v1/rerank`` and ``/classify`` serve them over HTTP."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from radixserve.runtime.engine import Engine
from radixserve.server import ServerConfig, create_app
from radixserve.server.testing import ServerThread
from tests.tiny_model import make_tiny_classifier, make_tiny_model, write_tiny_gguf

QUERY = "which tower was finished in 1889 for the world fair in the city of Paris"
DOCS = ["The tower was finished in 1889.", "Bananas are yellow.", "Paris hosted the fair.", "1889 was a year."]
# A score template in the shape of Qwen3-Reranker's (vLLM's --chat-template for it): the instruction, the query
# and the document in one user turn.
TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document answers the Query.<|im_end|>\n<|im_start|>user\n"
    "<Instruct>: {{ instruction | default('Find the passage') }}\n"
    "<Query>: {{ (messages | selectattr('role', 'eq', 'query') | first).content }}\n"
    "<Document>: {{ (messages | selectattr('role', 'eq', 'document') | first).content }}<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("classifiers")
    return {
        "one": make_tiny_classifier(root / "one", num_labels=1),
        "three": make_tiny_classifier(root / "three", num_labels=3, seed=1),
        # Gemma 2 soft-caps its language model's logits, never a classifier's: outputs in the hundreds show it.
        "gemma": make_tiny_classifier(root / "gemma", num_labels=2, seed=3, arch="gemma2", scale=50.0),
        "lm": make_tiny_model(root / "lm", arch="qwen3", tie=False, seed=2),
    }


def _engine(folder: Path, **overrides) -> Engine:
    # Chunks of 16 tokens: the pairs' prompts are computed over several steps, beside each other.
    return Engine(model=str(folder), device="cpu", dtype="float32", max_total_tokens=4096, chunked_prefill_size=16,
                  **overrides)  # fmt: skip


def _hf_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


@pytest.mark.parametrize("which", ["one", "three", "gemma"])
def test_a_sequence_classifier_gives_transformers_logits(folders: dict[str, Path], which: str) -> None:
    """The head's logits at the last token, over chunked prefill, batching and (the second pass) cached prefixes:
    the pairs of one query share its head."""
    engine = _engine(folders[which])
    try:
        assert engine.pooling is not None and engine.pooling.labels == tuple(
            f"LABEL_{i}" for i in range({"one": 1, "three": 3, "gemma": 2}[which])
        )
        texts = [QUERY + doc for doc in DOCS]
        first, second = engine.embed(texts), engine.embed(texts)
        for k, text in enumerate(texts):
            want = _hf_logits(folders[which], engine.tokenizer.encode(text))
            if which == "gemma":
                assert want.abs().max() > 60  # (where a soft-cap of 30 would show)
            for out in (first[k], second[k]):
                assert out.error is None
                torch.testing.assert_close(torch.tensor(out.embedding), want, atol=2e-5, rtol=1e-5)
        assert all(o.cached_tokens > 10 for o in first[1:])  # the query that the first pair computed
        with pytest.raises(ValueError, match="generates no text"):
            engine.generate(QUERY, {"max_new_tokens": 4})
    finally:
        engine.shutdown()


def test_a_language_model_read_at_two_tokens_is_a_yes_no_reranker(folders: dict[str, Path]) -> None:
    """vLLM's ``classifier_from_token`` with ``is_original_qwen3_reranker`` (Qwen3-Reranker as published): one
    output, the second token's logit minus the first's, from the model's own head."""
    folder = folders["lm"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    no, yes = "n", "y"
    assert tokenizer.convert_tokens_to_ids(no) is not None and tokenizer.convert_tokens_to_ids(yes) is not None
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, yes],
                 "is_original_qwen3_reranker": True}  # fmt: skip
    engine = _engine(folder, hf_overrides=json.dumps(overrides))
    try:
        assert engine.pooling is not None and engine.pooling.labels == (yes,)
        lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        texts = [QUERY + doc for doc in DOCS]
        for text, out in zip(texts, engine.embed(texts)):
            with torch.no_grad():
                logits = lm(torch.tensor([engine.tokenizer.encode(text)])).logits[0, -1]
            want = logits[tokenizer.convert_tokens_to_ids(yes)] - logits[tokenizer.convert_tokens_to_ids(no)]
            assert out.embedding == pytest.approx([want.item()], abs=2e-5)
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="not a token"):
        _engine(folder, hf_overrides=json.dumps({**overrides, "classifier_from_token": ["no-such-token", yes]}))


@pytest.fixture(scope="module")
def server(folders: dict[str, Path]) -> Iterator[tuple[Engine, str]]:
    engine = _engine(folders["one"])
    with ServerThread(create_app(engine, ServerConfig(served_model_name="tiny-rerank"))) as srv:
        yield engine, srv.url
    engine.shutdown()


def test_rerank_and_score_are_the_classifiers_probabilities(
    server: tuple[Engine, str], folders: dict[str, Path]
) -> None:
    """A pair's prompt is the query then the document (no template); its score the sigmoid of the one logit;
    rerank orders by it; usage counts the pairs' tokens and the cached query head."""
    engine, url = server
    ids = [engine.tokenizer.encode(QUERY + doc) for doc in DOCS]
    want = [_sigmoid(_hf_logits(folders["one"], x)[0].item()) for x in ids]
    ranked = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": DOCS}).json()
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    assert [r["index"] for r in ranked["results"]] == order
    assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx([want[i] for i in order], abs=1e-5)
    assert ranked["results"][0]["document"] == {"text": DOCS[order[0]]}
    assert ranked["usage"]["total_tokens"] == sum(map(len, ids))
    assert ranked["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * 10
    as_objects = [{"text": d} for d in DOCS]  # (Cohere's v1 and Jina's document objects)
    same = httpx.post(url + "/v1/rerank", json={"query": QUERY, "documents": as_objects}).json()
    assert [r["relevance_score"] for r in same["results"]] == pytest.approx([want[i] for i in order], abs=1e-5)
    scored = httpx.post(url + "/v1/score", json={"queries": QUERY, "documents": DOCS}).json()
    assert [d["score"] for d in scored["data"]] == pytest.approx(want, abs=1e-5)
    pairs = httpx.post(url + "/score", json={"text_1": [QUERY, QUERY], "text_2": DOCS[:2]}).json()
    assert [d["score"] for d in pairs["data"]] == pytest.approx(want[:2], abs=1e-5)
    raw = httpx.post(url + "/v1/score", json={"text_1": QUERY, "text_2": DOCS[0], "use_activation": False}).json()
    assert raw["data"][0]["score"] == pytest.approx(math.log(want[0] / (1 - want[0])), abs=1e-4)
    short = httpx.post(url + "/v1/score", json={"text_1": QUERY, "text_2": DOCS[0], "max_tokens_per_query": 3})
    cut = engine.tokenizer.decode(engine.tokenizer.encode(QUERY, add_special_tokens=False)[:3])
    want_short = _sigmoid(_hf_logits(folders["one"], engine.tokenizer.encode(cut + DOCS[0]))[0].item())
    assert short.json()["data"][0]["score"] == pytest.approx(want_short, abs=1e-5)


def test_a_pair_over_the_limit_loses_the_end_of_its_document(
    server: tuple[Engine, str], folders: dict[str, Path]
) -> None:
    """``truncate_prompt_tokens`` cuts the document, never the query (which a cut from the left would lose); a
    query too long on its own is a 400."""
    engine, url = server
    doc = " ".join(DOCS * 4)
    limit = len(engine.tokenizer.encode(QUERY)) + 6
    got = httpx.post(url + "/v1/score", json={"text_1": QUERY, "text_2": doc, "truncate_prompt_tokens": limit}).json()
    assert got["usage"]["prompt_tokens"] <= limit
    doc_ids = engine.tokenizer.encode(doc, add_special_tokens=False)
    kept = next(k for k in range(len(doc_ids), 0, -1)
                if len(engine.tokenizer.encode(QUERY + engine.tokenizer.decode(doc_ids[:k]))) <= limit)  # fmt: skip
    prompt = engine.tokenizer.encode(QUERY + engine.tokenizer.decode(doc_ids[:kept]))
    assert prompt[: len(engine.tokenizer.encode(QUERY)) - 1] == engine.tokenizer.encode(QUERY)[:-1]
    want = _sigmoid(_hf_logits(folders["one"], prompt)[0].item())
    assert got["data"][0]["score"] == pytest.approx(want, abs=1e-5)
    too_long = httpx.post(url + "/v1/score", json={"text_1": QUERY, "text_2": doc, "truncate_prompt_tokens": 4})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "query"


def test_a_score_template_renders_each_pair(folders: dict[str, Path], tmp_path: Path) -> None:
    """``--chat-template`` is the score template: the pair as a query and a document message, the request's
    ``instruction`` as a template variable."""
    (tmp_path / "rerank.jinja").write_text(TEMPLATE)
    engine = _engine(folders["one"])
    try:
        config = ServerConfig(served_model_name="tiny-rerank", chat_template=str(tmp_path / "rerank.jinja"))
        with ServerThread(create_app(engine, config)) as srv:
            body = {"query": QUERY, "documents": DOCS[:2], "instruction": "Rank the passages"}
            got = httpx.post(srv.url + "/v1/rerank", json=body).json()
            reserved = httpx.post(srv.url + "/v1/rerank", json={**body, "chat_template_kwargs": {"tokenize": True}})
            assert reserved.status_code == 400 and "may not set tokenize" in reserved.json()["error"]["message"]
        by_index = {r["index"]: r["relevance_score"] for r in got["results"]}
        tokenizer = AutoTokenizer.from_pretrained(folders["one"])
        for k, doc in enumerate(DOCS[:2]):
            messages = [{"role": "query", "content": QUERY}, {"role": "document", "content": doc}]
            text = tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False,
                                                 instruction="Rank the passages")  # fmt: skip
            assert f"<Instruct>: Rank the passages\n<Query>: {QUERY}\n<Document>: {doc}<|im_end|>" in text
            want = _sigmoid(_hf_logits(folders["one"], engine.tokenizer.encode(text))[0].item())
            assert by_index[k] == pytest.approx(want, abs=1e-5)
    finally:
        engine.shutdown()


def test_classify_gives_each_labels_probability(folders: dict[str, Path]) -> None:
    """vLLM's /classify: softmax over several outputs, the most probable label; scores need one output."""
    engine = _engine(folders["three"])
    try:
        with ServerThread(create_app(engine, ServerConfig(served_model_name="tiny-cls"))) as srv:
            got = httpx.post(srv.url + "/classify", json={"input": DOCS[:2]}).json()
            ids = [engine.tokenizer.encode(d) for d in DOCS[:2]]
            for item, x in zip(got["data"], ids):
                want = torch.softmax(_hf_logits(folders["three"], x), dim=0).tolist()
                assert item["probs"] == pytest.approx(want, abs=1e-5) and item["num_classes"] == 3
                assert item["label"] == f"LABEL_{max(range(3), key=want.__getitem__)}"
            assert got["usage"]["prompt_tokens"] == sum(map(len, ids)) and got["model"] == "tiny-cls"
            raw = httpx.post(srv.url + "/v1/classify", json={"input": ids[0], "use_activation": False}).json()
            assert raw["data"][0]["probs"] == pytest.approx(_hf_logits(folders["three"], ids[0]).tolist(), abs=2e-5)
            chat = [{"role": "user", "content": DOCS[0]}]
            text = engine.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
            chat_ids = engine.tokenizer.encode(text, add_special_tokens=False)
            want = torch.softmax(_hf_logits(folders["three"], chat_ids), dim=0)
            got_chat = httpx.post(srv.url + "/v1/classify", json={"messages": chat}).json()
            assert got_chat["data"][0]["probs"] == pytest.approx(want.tolist(), abs=1e-5)
            refused = httpx.post(srv.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS})
            assert refused.status_code == 400 and "/classify" in refused.json()["error"]["message"]
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/embeddings", {"input": "x"}, "model", "serves a classifier"),
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents", "at least one"),
        ("/v1/score", {"text_1": QUERY}, "text_1", "text_1 and text_2"),
        ("/v1/score", {"text_1": QUERY, "text_2": "x", "queries": QUERY, "documents": "x"}, "text_1", "text_1 and"),
        ("/v1/score", {"text_1": QUERY, "text_2": "x", "chat_template_kwargs": {"a": 1}}, None, "--chat-template"),
        ("/v1/score", {"text_1": QUERY, "text_2": "x", "instruction": "rank"}, "instruction", "--chat-template"),
        ("/v1/classify", {"input": []}, "input", "empty list"),
        ("/v1/classify", {"input": "x" * 5000}, "input", "context length"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, None, "generates no text"),
    ],
)
def test_bad_requests_to_a_classifier_are_clear_400s(
    server: tuple[Engine, str], path: str, body: dict, param: str | None, words: str
) -> None:
    _, url = server
    resp = httpx.post(url + path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert words in error["message"] and (param is None or error["param"] == param), error


def test_a_classifier_is_not_served_as_a_text_model(folders: dict[str, Path]) -> None:
    """Refused with --runner generate; with --load-format dummy its head is random, of the config's shape."""
    with pytest.raises(ValueError, match="sequence classifier"):
        _engine(folders["one"], runner="generate")
    engine = _engine(folders["three"], load_format="dummy")
    try:
        out = engine.embed([QUERY])[0]
        assert out.error is None and len(out.embedding) == 3
    finally:
        engine.shutdown()


def test_an_engine_process_and_the_router_serve_a_classifier(
    server: tuple[Engine, str], folders: dict[str, Path]
) -> None:
    """The classifier's labels travel to the front end in the ready message; the router forwards /classify and
    the score routes, routing a score by its queries."""
    from radixserve.runtime.engine_process import EngineProcess
    from radixserve.server.router.config import RouterConfig, RoutingConfig
    from radixserve.server.router.process import build_http_router

    local, url = server
    want = [_sigmoid(o.embedding[0]) for o in local.embed([QUERY + d for d in DOCS[:2]])]
    app = build_http_router(RouterConfig(worker_urls=(url,)), RoutingConfig(policy="cache_aware"))
    with ServerThread(app) as router:
        for path in ("/v1/classify", "/classify"):
            got = httpx.post(router.url + path, json={"input": [QUERY + d for d in DOCS[:2]]})
            assert [d["probs"][0] for d in got.json()["data"]] == pytest.approx(want, abs=1e-5), got.text
        scored = httpx.post(router.url + "/v1/score", json={"queries": QUERY, "documents": DOCS[:2]})
        assert [d["score"] for d in scored.json()["data"]] == pytest.approx(want, abs=1e-5), scored.text
    proc = EngineProcess(model=str(folders["three"]), device="cpu", dtype="float32", max_total_tokens=4096)
    try:
        assert proc.pooling is not None and proc.pooling.labels == ("LABEL_0", "LABEL_1", "LABEL_2")
        with ServerThread(create_app(proc, ServerConfig())) as srv:
            got = httpx.post(srv.url + "/v1/classify", json={"input": DOCS[0]}).json()
        want3 = torch.softmax(_hf_logits(folders["three"], proc.tokenizer.encode(DOCS[0])), dim=0).tolist()
        assert got["data"][0]["probs"] == pytest.approx(want3, abs=1e-5)
    finally:
        proc.shutdown()


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_a_gguf_language_model_serves_as_a_yes_no_reranker(tmp_path: Path, qtype: str) -> None:
    """A reranker published as a GGUF of its language model (as Qwen3-Reranker's GGUFs are) serves with the same
    overrides: the head's rows are read from the file's blocks (dequantized where they are blocks)."""
    folder = make_tiny_model(tmp_path / "lm", tie=False, seed=4)
    gguf = write_tiny_gguf(folder, tmp_path / f"lm.{qtype}.gguf", qtype=qtype)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    no, yes = "n", "y"
    overrides = {"architectures": ["LlamaForSequenceClassification"], "classifier_from_token": [no, yes],
                 "method": "from_2_way_softmax"}  # fmt: skip
    engine = _engine(gguf, hf_overrides=json.dumps(overrides))
    try:
        assert engine.pooling is not None and engine.pooling.labels == (yes,)
        lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # (the weights before the GGUF)
        texts = [QUERY + doc for doc in DOCS[:2]]
        for text, out in zip(texts, engine.embed(texts)):
            with torch.no_grad():
                logits = lm(torch.tensor([engine.tokenizer.encode(text)])).logits[0, -1]
            want = (logits[tokenizer.convert_tokens_to_ids(yes)] - logits[tokenizer.convert_tokens_to_ids(no)]).item()
            # F32 is the same weights; Q8_0 rounds every weight (and the block kernels their activations): the
            # outputs here are ~0.1 and Q8_0 moved them by under 1e-3.
            assert out.embedding == pytest.approx([want], abs=2e-5 if qtype == "F32" else 5e-3)
    finally:
        engine.shutdown()
