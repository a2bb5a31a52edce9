"""Embeddings (``--runner pooling``, ``/v1/embeddings``): a tiny random-weight Qwen3 saved as sentence-transformers
saves Qwen3-Embedding (the bare decoder, ``modules.json``, the pooling module's config), served in float32 and
compared with transformers' hidden states pooled by the folder's recipe."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModel

from radixserve.runtime.config import EngineConfig
from radixserve.runtime.engine import Engine
from radixserve.runtime.engine_process import EngineProcess
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.server import ServerConfig, create_app
from radixserve.server.testing import ServerThread
from tests.tiny_model import make_tiny_embedding

# Two texts with a long common head (the second hits the first's cached prefix) and one apart.
TEXTS = [
    "Instruct: find the passage that answers the question\nQuery: what is the capital of France",
    "Instruct: find the passage that answers the question\nQuery: how tall is the tower in Paris",
    "The tower was finished in 1889 for the world fair.",
]
POOLERS = {"lasttoken": lambda h: h[-1], "mean_tokens": lambda h: h.mean(0), "cls_token": lambda h: h[0]}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embedding-models")
    made = {mode: make_tiny_embedding(root / mode, pooling=mode) for mode in POOLERS}
    made["matryoshka"] = make_tiny_embedding(root / "matryoshka", config_overrides={"matryoshka_dimensions": [16, 32]})
    return made


def _reference(folder: Path, ids: list[int], mode: str) -> torch.Tensor:
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    return torch.nn.functional.normalize(POOLERS[mode](hidden), dim=0)


def _engine(folder: Path, **overrides) -> Engine:
    # Chunks of 16 tokens: every prompt is pooled over several steps, beside the others.
    return Engine(model=str(folder), device="cpu", dtype="float32", max_total_tokens=4096, chunked_prefill_size=16,
                  **overrides)  # fmt: skip


@pytest.mark.parametrize("mode", list(POOLERS))
def test_embeddings_are_the_models_recipe_over_its_hidden_states(folders: dict[str, Path], mode: str) -> None:
    """Last token, mean and first token (read from the folder), normalized, over chunked prefill and a batch; a
    second pass hits the cache for last-token pooling (the shared instruction, then whole prompts) and is equal."""
    engine = _engine(folders[mode])
    try:
        assert engine.pooling is not None and engine.pooling.default.kind == {"lasttoken": "last",
                                                                             "mean_tokens": "mean",
                                                                             "cls_token": "cls"}[mode]  # fmt: skip
        ids = [engine.tokenizer.encode(t) for t in TEXTS]
        first, second = engine.embed(ids), engine.embed(TEXTS)
        for k, want_ids in enumerate(ids):
            want = _reference(folders[mode], want_ids, mode)
            for out in (first[k], second[k]):
                assert out.error is None and out.prompt_tokens == len(want_ids)
                torch.testing.assert_close(torch.tensor(out.embedding), want, atol=2e-6, rtol=0)
        if mode == "lasttoken":
            assert first[1].cached_tokens > 10  # the instruction the first text computed in the same batch
            assert [o.cached_tokens for o in second] == [len(x) - 1 for x in ids]
        else:  # every token's hidden state is read: no cached prefix stands in for it
            assert [o.cached_tokens for o in first + second] == [0] * 6
        with pytest.raises(ValueError, match="generates no text"):
            engine.generate(TEXTS[0], {"max_new_tokens": 4})
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def server(folders: dict[str, Path]) -> Iterator[tuple[Engine, str]]:
    engine = _engine(folders["matryoshka"])
    with ServerThread(create_app(engine, ServerConfig(served_model_name="tiny-embed"))) as srv:
        yield engine, srv.url
    engine.shutdown()


def test_the_openai_client_gets_the_embeddings(server: tuple[Engine, str]) -> None:
    """The SDK's default asks for base64 (decoded by the SDK), floats on request; texts and token ids; usage."""
    engine, url = server
    want = [o.embedding for o in engine.embed(TEXTS)]
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    got = client.embeddings.create(model="tiny-embed", input=TEXTS)
    assert got.model == "tiny-embed" and [d.index for d in got.data] == [0, 1, 2]
    for d, w in zip(got.data, want):
        assert d.embedding == pytest.approx(w, abs=1e-7)  # (float32 on the wire either way)
    floats = client.embeddings.create(model="tiny-embed", input=TEXTS[2], encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(want[2], abs=1e-7)
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    by_ids = client.embeddings.create(model="tiny-embed", input=ids, encoding_format="float")
    for d, w in zip(by_ids.data, want):
        assert d.embedding == pytest.approx(w, abs=1e-7)
    assert by_ids.usage.prompt_tokens == by_ids.usage.total_tokens == sum(map(len, ids))
    raw = httpx.post(url + "/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == pytest.approx(want[0], abs=1e-7)
    assert raw["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids[0]) - 1


def test_matryoshka_dimensions_and_normalize(server: tuple[Engine, str]) -> None:
    """``dimensions`` keeps the first N values, then normalizes (as OpenAI's and vLLM's); only the lengths the
    model was trained for."""
    engine, url = server
    full = engine.embed([TEXTS[0]], normalize=False)[0].embedding
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    short = client.embeddings.create(model="tiny-embed", input=TEXTS[0], dimensions=16).data[0].embedding
    assert len(short) == 16
    want = torch.nn.functional.normalize(torch.tensor(full[:16]), dim=0).tolist()
    assert short == pytest.approx(want, abs=1e-6)
    raw = httpx.post(url + "/v1/embeddings", json={"input": TEXTS[0], "normalize": False}).json()
    assert raw["data"][0]["embedding"] == pytest.approx(full, abs=1e-7)
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="tiny-embed", input=TEXTS[0], dimensions=20)
    assert err.value.body["param"] == "dimensions" and "16, 32" in err.value.body["message"]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": []}, "input", "empty list"),
        ({"input": ""}, "input", "input 0 is empty"),
        ({"input": [[1, 2], []]}, "input", "input 1 is empty"),
        ({"input": [1, 2, 10**9]}, "input", "out of range"),
        ({"input": "x" * 5000}, "input", "context length"),
        ({"input": "x", "model": "other"}, "model", "does not exist"),
        ({"input": "x", "encoding_format": "hex"}, None, "encoding_format"),
        ({"input": "x", "dimensions": 0}, None, "dimensions"),
    ],
)
def test_bad_embedding_requests_are_clear_400s(
    server: tuple[Engine, str], body: dict, param: str | None, words: str
) -> None:
    _, url = server
    resp = httpx.post(url + "/v1/embeddings", json=body)
    assert resp.status_code in (400, 404), resp.text
    error = resp.json()["error"]
    assert words in error["message"] and (param is None or error["param"] == param), error


def test_chat_style_inputs_are_rendered_by_the_chat_template(server: tuple[Engine, str]) -> None:
    """vLLM's chat form: ``messages`` (one conversation or several) or a conversation as ``input``, rendered by the
    template without a generation prompt and tokenized without special tokens (its defaults)."""
    engine, url = server
    conv = [{"role": "system", "content": "Represent the query."}, {"role": "user", "content": TEXTS[0]}]

    def want(messages: list[dict]) -> list[float]:
        text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        return engine.embed([engine.tokenizer.encode(text, add_special_tokens=False)])[0].embedding

    one = httpx.post(url + "/v1/embeddings", json={"messages": conv}).json()
    assert len(one["data"]) == 1 and one["data"][0]["embedding"] == pytest.approx(want(conv), abs=1e-7)
    many = httpx.post(url + "/v1/embeddings", json={"messages": [conv, conv[1:]]}).json()
    assert [d["embedding"] for d in many["data"]] == [pytest.approx(want(conv), abs=1e-7),
                                                      pytest.approx(want(conv[1:]), abs=1e-7)]  # fmt: skip
    as_input = httpx.post(url + "/v1/embeddings", json={"input": conv}).json()
    assert as_input["data"][0]["embedding"] == pytest.approx(want(conv), abs=1e-7)
    for body, words in (({"messages": []}, "at least one message"), ({"messages": [conv, []]}, "at least one"),
                        ({"input": "x", "messages": conv}, "not both"), ({}, "input (or messages) is required"),
                        ({"messages": [{"role": "user"}]}, "needs content"),
                        ({"messages": conv, "continue_final_message": True}, "assistant")):  # fmt: skip
        resp = httpx.post(url + "/v1/embeddings", json=body)
        assert resp.status_code == 400 and words in resp.json()["error"]["message"], (body, resp.text)


def test_truncation_and_generation_on_an_embedding_server(server: tuple[Engine, str]) -> None:
    engine, url = server
    ids = engine.tokenizer.encode("x" * 5000)
    cut = httpx.post(url + "/v1/embeddings", json={"input": ids, "truncate_prompt_tokens": 100}).json()
    assert cut["usage"]["prompt_tokens"] == 100
    assert cut["data"][0]["embedding"] == pytest.approx(engine.embed([ids[-100:]])[0].embedding, abs=1e-7)
    chat = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "serves embeddings" in chat.json()["error"]["message"]


def test_a_text_model_refuses_embeddings(tiny_model_dir: Path) -> None:
    engine = Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=1024)
    try:
        assert engine.pooling is None
        with ServerThread(create_app(engine, ServerConfig())) as srv:
            resp = httpx.post(srv.url + "/v1/embeddings", json={"input": "hello"})
        assert resp.status_code == 400 and "--runner pooling" in resp.json()["error"]["message"]
        with pytest.raises(ValueError, match="--runner pooling"):
            engine.embed(["hello"])
        params = SamplingParams(max_new_tokens=0, pooling=None)
        assert engine.generate("hello", params)["meta_info"]["error"] is None
    finally:
        engine.shutdown()


def test_an_engine_process_serves_embeddings(folders: dict[str, Path]) -> None:
    """Across the process boundary (the pooling recipe travels in the ready message; the front end refuses a text
    request at once)."""
    local = _engine(folders["lasttoken"])
    want = [o.embedding for o in local.embed(TEXTS)]
    local.shutdown()
    proc = EngineProcess(model=str(folders["lasttoken"]), device="cpu", dtype="float32", max_total_tokens=4096)
    try:
        assert proc.pooling is not None and proc.pooling.default.kind == "last"
        got = proc.embed(TEXTS)
        for out, w in zip(got, want):
            torch.testing.assert_close(torch.tensor(out.embedding), torch.tensor(w), atol=2e-6, rtol=0)
        with pytest.raises(ValueError, match="generates no text"):
            proc.generate("hello", {"max_new_tokens": 2})
    finally:
        proc.shutdown()


def test_runner_choice_and_recipes_this_server_cannot_follow(folders: dict[str, Path], tmp_path: Path) -> None:
    """auto serves embeddings for a sentence-transformers folder; --runner generate serves its text (the head tied
    to the embedding); a recipe with a module this server does not run is refused at start, named."""
    assert EngineConfig(runner="auto").runner == "auto"
    with pytest.raises(ValueError, match="--runner must be"):
        EngineConfig(runner="embed")
    odd = make_tiny_embedding(tmp_path / "dense", bare=False)
    modules = json.loads((odd / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (odd / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="sentence_transformers.models.Dense"):
        _engine(odd)
    weighted = make_tiny_embedding(tmp_path / "weighted", pooling="weightedmean_tokens")
    with pytest.raises(ValueError, match="weightedmean_tokens is not supported"):
        _engine(weighted)
    text = Engine(model=str(folders["lasttoken"]), device="cpu", max_total_tokens=1024, runner="generate")
    try:
        assert text.pooling is None
        assert len(text.generate("hello", {"max_new_tokens": 3, "ignore_eos": True})["output_ids"]) == 3
    finally:
        text.shutdown()


def test_a_call_of_more_inputs_than_the_queue_holds(server: tuple[Engine, str]) -> None:
    """Each input is a request; a call's inputs go in waves, so 1,100 inputs on a server whose queue holds 1,024
    all come back (they used to be a 429 on an idle server)."""
    engine, url = server
    inputs = [[5 + k % 200, 7, 9 + k % 50] for k in range(1100)]
    resp = httpx.post(url + "/v1/embeddings", json={"input": inputs}, timeout=300)
    assert resp.status_code == 200, resp.text[:300]
    data = resp.json()["data"]
    assert [d["index"] for d in data] == list(range(1100))
    assert data[1099]["embedding"] == pytest.approx(engine.embed([inputs[1099]])[0].embedding, abs=1e-7)
    assert len(engine.embed(inputs[:1030])) == 1030  # (in process too)


def test_an_input_as_long_as_the_context(server: tuple[Engine, str]) -> None:
    """An embedding generates nothing: an input may fill the whole context (as vLLM allows), not one more."""
    engine, url = server
    ctx = engine.max_context_len
    ids = [(7 * k) % 300 + 5 for k in range(ctx + 10)]
    full = httpx.post(url + "/v1/embeddings", json={"input": ids[:ctx]})
    assert full.status_code == 200 and full.json()["usage"]["prompt_tokens"] == ctx
    over = httpx.post(url + "/v1/embeddings", json={"input": ids[: ctx + 1]})
    assert over.status_code == 400 and "context length" in over.json()["error"]["message"]
    cut = httpx.post(url + "/v1/embeddings", json={"input": ids, "truncate_prompt_tokens": -1}).json()
    assert cut["usage"]["prompt_tokens"] == ctx


def test_a_non_finite_hidden_state_anywhere_fails_that_input(folders: dict[str, Path]) -> None:
    """Mean pooling reads every row: a NaN in a row the chunk's last-row check does not see fails the request (a
    400/500 in the API, never a vector of NaNs or a body that is not JSON), and its KV is not cached."""
    engine = _engine(folders["mean_tokens"])
    model = engine.core.runner.model
    real_forward = model.forward
    poison = 11

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        hidden = real_forward(input_ids, positions, ctx)
        rows = (input_ids == poison).nonzero().flatten()
        if len(rows):
            hidden = hidden.clone()
            hidden[rows] = float("inf")
        return hidden

    try:
        engine.call(lambda core: setattr(model, "forward", forward))
        bad, good = engine.embed([[poison, 20, 21, 22], [20, 21, 22, 23]])
        assert bad.embedding is None and "non-finite" in (bad.error or "")
        assert good.error is None and good.embedding is not None
        assert engine.call(lambda core: core.cache.peek_prefix_len([poison, 20, 21, 22, 1])) == 0
    finally:
        engine.call(lambda core: setattr(model, "forward", real_forward))
        engine.shutdown()


def test_hf_overrides_make_a_model_matryoshka(folders: dict[str, Path]) -> None:
    """vLLM's --hf-overrides: Qwen3-Embedding's config.json does not say it was trained for shorter embeddings."""
    plain = _engine(folders["lasttoken"])
    try:
        with pytest.raises(ValueError, match="Matryoshka"):
            plain.embed(["hello"], dimensions=8)
    finally:
        plain.shutdown()
    engine = _engine(folders["lasttoken"], hf_overrides='{"is_matryoshka": true}')
    try:
        full = engine.embed(["hello"], normalize=False)[0].embedding
        short = engine.embed(["hello"], dimensions=8)[0].embedding
        assert short == pytest.approx(torch.nn.functional.normalize(torch.tensor(full[:8]), dim=0).tolist(), abs=1e-6)
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="JSON object"):
        EngineConfig(hf_overrides="[1]")


def test_tensor_parallel_is_refused_before_any_rank_starts(folders: dict[str, Path]) -> None:
    import multiprocessing

    with pytest.raises(ValueError, match="--tp > 1"):
        Engine(model=str(folders["lasttoken"]), device="cpu", tp=2, max_total_tokens=1024)
    assert multiprocessing.active_children() == []


def test_score_and_rerank_by_cosine_similarity(server: tuple[Engine, str]) -> None:
    """vLLM's /score and the Jina/Cohere /rerank over an embedding model: cosine similarities of the embeddings,
    each distinct text embedded once."""
    engine, url = server
    query, docs = TEXTS[0], [TEXTS[2], TEXTS[1], "Paris is the capital of France."]
    vectors = {t: torch.tensor(o.embedding) for t, o in zip([query, *docs], engine.embed([query, *docs]))}
    want = [float(torch.nn.functional.cosine_similarity(vectors[query], vectors[d], dim=0)) for d in docs]
    scored = httpx.post(url + "/v1/score", json={"text_1": query, "text_2": docs}).json()
    assert [d["score"] for d in scored["data"]] == pytest.approx(want, abs=1e-5)
    assert scored["usage"]["prompt_tokens"] == sum(len(engine.tokenizer.encode(t)) for t in [query, *docs])
    pairs = httpx.post(url + "/score", json={"text_1": [query, docs[0]], "text_2": [docs[1], docs[0]]}).json()
    assert pairs["data"][1]["score"] == pytest.approx(1.0, abs=1e-5)
    ranked = httpx.post(url + "/v1/rerank", json={"query": query, "documents": docs, "top_n": 2}).json()
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in ranked["results"]] == order
    assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx([want[i] for i in order], abs=1e-5)
    assert ranked["results"][0]["document"] == {"text": docs[order[0]]}
    bare = httpx.post(url + "/rerank", json={"query": query, "documents": docs, "return_documents": False}).json()
    assert len(bare["results"]) == 3 and "document" not in bare["results"][0]
    for path, body, param in [
        ("/v1/score", {"text_1": [query, query], "text_2": docs}, "text_1"),
        ("/v1/score", {"text_1": [], "text_2": docs}, "text_1"),
        ("/v1/rerank", {"query": query, "documents": []}, "documents"),
        ("/v1/rerank", {"query": query, "documents": ["ok", ""]}, "documents"),
    ]:
        resp = httpx.post(url + path, json=body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_the_router_forwards_embeddings_and_scores(server: tuple[Engine, str]) -> None:
    from radixserve.server.router.config import RouterConfig, RoutingConfig
    from radixserve.server.router.process import build_http_router

    engine, url = server
    want = engine.embed([TEXTS[0]])[0].embedding
    app = build_http_router(RouterConfig(worker_urls=(url,)), RoutingConfig(policy="cache_aware"))
    with ServerThread(app) as router:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
        assert client.embeddings.create(model="tiny-embed", input=TEXTS[0]).data[0].embedding == pytest.approx(
            want, abs=1e-7
        )
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            ranked = httpx.post(router.url + path, json={"query": TEXTS[0], "documents": TEXTS[1:]})
            assert ranked.status_code == 200 and len(ranked.json()["results"]) == 2, ranked.text
        scored = httpx.post(router.url + "/score", json={"text_1": TEXTS[0], "text_2": TEXTS[0]})
        assert scored.json()["data"][0]["score"] == pytest.approx(1.0, abs=1e-5)
