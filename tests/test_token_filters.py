"""vLLM's token filters: ``allowed_token_ids``, ``bad_words``, ``include_stop_str_in_output`` and
``truncate_prompt_tokens``: in the sampler alone, in the engine on the tiny random model, and over HTTP with the
official client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from radixserve.runtime.engine import Engine
from radixserve.runtime.sampler import NoAllowedTokenError
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.server import ServerConfig, create_app
from radixserve.server.testing import ServerThread
from tests.test_sampler import EOS, V, make_req, make_sampler, rand_logits
from tests.test_server_tiny import MODEL, USER, assert_error


# ------------------------------------------------------------------------------------------------ sampler
def test_allowed_token_ids_bound_every_row_greedy_or_sampled() -> None:
    allowed = [3, 7, 11]
    reqs = [make_req(f"r{i}", temperature=0.0 if i % 2 else 2.0, seed=i, allowed_token_ids=allowed) for i in range(64)]
    free = make_req("free", temperature=0.0)
    out = make_sampler().sample(rand_logits(65, seed=1), [*reqs, free]).token_ids
    assert set(out[:64]) <= set(allowed) and len(set(out[:64])) > 1
    assert out[64] == int(rand_logits(65, seed=1)[64].argmax())  # a row without the field is left alone


def test_allowed_token_ids_that_a_grammar_forbids_fail_the_request() -> None:
    grammar = torch.zeros(1, V, dtype=torch.bool)
    grammar[0, 5] = True
    with pytest.raises(NoAllowedTokenError, match="allowed_token_ids"):
        make_sampler().sample(rand_logits(1, seed=2), [make_req("r", allowed_token_ids=[3])], grammar)


def test_min_tokens_yield_to_allowed_token_ids() -> None:
    """Only EOS allowed and min_tokens unmet: EOS, as with a grammar (the row was left empty: a token outside the
    allowed ones greedily, an engine fault when sampled)."""
    s = make_sampler()
    for temperature in (0.0, 1.0):
        req = make_req("r", temperature=temperature, seed=1, allowed_token_ids=[EOS], min_new_tokens=2)
        assert s.sample(rand_logits(1, seed=3), [req]).token_ids == [EOS]


def test_bad_words_ban_the_last_token_after_the_rest() -> None:
    logits = torch.zeros(1, V)
    logits[0, 9], logits[0, 8] = 10.0, 9.0
    s = make_sampler()
    one_token = make_req("r", temperature=0.0, bad_words_ids=[[9]])
    assert s.sample(logits, [one_token]).token_ids == [8]
    two_tokens = make_req("r", temperature=0.0, bad_words_ids=[[4, 9]], output=[1, 2])
    assert s.sample(logits, [two_tokens]).token_ids == [9]  # the output does not end with 4: 9 is fine
    two_tokens.output_ids = [1, 4]
    assert s.sample(logits, [two_tokens]).token_ids == [8]
    # A grammar that allows only the banned token decides: the ban yields rather than fail the request.
    grammar = torch.zeros(1, V, dtype=torch.bool)
    grammar[0, 9] = True
    assert s.sample(logits, [make_req("r", temperature=0.0, bad_words_ids=[[9]])], grammar).token_ids == [9]


def test_token_filters_are_validated() -> None:
    for bad in ({"allowed_token_ids": [V]}, {"bad_words_ids": [[1, V]]}, {"bad_words_ids": [[]]}):
        with pytest.raises(ValueError):
            SamplingParams(**bad).validate(V)
    assert SamplingParams(allowed_token_ids=[EOS]).edits_logits and not SamplingParams().edits_logits


# ------------------------------------------------------------------------------------------------ engine
@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    eng = Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=4096)
    yield eng
    eng.shutdown()


def test_the_engine_applies_the_filters(engine: Engine) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. The quick brown fox"
    free = engine.generate(prompt, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))
    stop = free["text"][4:7]
    kept = engine.generate(prompt, SamplingParams(max_new_tokens=24, temperature=0.0, stop=[stop],
                                                  include_stop_str_in_output=True))  # fmt: skip
    assert kept["text"] == free["text"][: free["text"].index(stop) + len(stop)]
    assert kept["meta_info"]["matched_stop"] == stop
    ids = free["output_ids"]
    pair = ids[:2]  # the first token alone stays allowed; after it, the second never comes
    banned = engine.generate(prompt, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True,
                                                    bad_words_ids=[pair]))["output_ids"]  # fmt: skip
    assert banned[0] == ids[0] and all(banned[i : i + 2] != pair for i in range(len(banned)))
    single = engine.generate(prompt, SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True,
                                                    bad_words_ids=[[ids[0]]]))["output_ids"]  # fmt: skip
    assert ids[0] not in single
    allowed = engine.generate(prompt, SamplingParams(max_new_tokens=24, temperature=1.0, seed=3, ignore_eos=True,
                                                     allowed_token_ids=ids[:4]))  # fmt: skip
    assert set(allowed["output_ids"]) <= set(ids[:4])


def test_a_stop_token_text_is_cut_unless_asked_for(engine: Engine) -> None:
    """As vLLM and SGLang: the text of the token that stopped the answer (a stop_token_ids entry, or EOS) is not in
    the answer, unless include_stop_str_in_output / no_stop_trim."""
    prompt = "Once upon a time, in a land far away, there lived"
    free = engine.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
    ids = free["output_ids"]
    stop = next(t for t in ids[2:] if engine.tokenizer.decode([t]).strip())  # a token with visible text
    cut = engine.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=[stop]))
    kept = engine.generate(prompt, SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=[stop],
                                                  include_stop_str_in_output=True))  # fmt: skip
    assert cut["output_ids"] == kept["output_ids"] and cut["output_ids"][-1] == stop
    assert kept["text"] == engine.tokenizer.decode(kept["output_ids"])
    assert cut["text"] == engine.tokenizer.decode(cut["output_ids"][:-1])


def test_a_grammar_forcing_a_token_outside_allowed_token_ids_fails_the_request(engine: Engine) -> None:
    """Jump-forward appends forced tokens without sampling: it is off for such requests, so the sampler's check
    fails the request instead of letting the forced token through."""
    from radixserve.constrained import ConstraintSpec

    forced = engine.tokenizer.encode("hello world", add_special_tokens=False)
    other = next(t for t in range(3, 200) if t not in forced)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, allowed_token_ids=[other],
                            constraint=ConstraintSpec("regex", "hello world"))  # fmt: skip
    out = engine.generate("Say it:", params)
    assert out["meta_info"]["finish_reason"] == "error" and "allowed_token_ids" in out["meta_info"]["error"]
    assert not set(out["output_ids"]) - {other}


# ------------------------------------------------------------------------------------------------ server
@pytest.fixture(scope="module")
def server(engine: Engine) -> Iterator[ServerThread]:
    with ServerThread(create_app(engine, ServerConfig(served_model_name=MODEL))) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_vllm_filter_fields_over_http(client: openai.OpenAI, server: ServerThread, engine: Engine) -> None:
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=16, temperature=0)
    free = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    stop = free[5:8]
    kept = client.completions.create(**kw, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == free[: free.index(stop) + len(stop)]
    streamed = client.completions.create(
        **kw, stop=[stop], stream=True, extra_body={"include_stop_str_in_output": True}
    )
    assert "".join(c.choices[0].text for c in streamed) == kept.choices[0].text
    # bad_words: the word's tokens never come out (read as ids: return_tokens_as_token_ids).
    as_ids = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    tokenizer = engine.tokenizer
    first = client.completions.create(**kw, logprobs=0, extra_body=as_ids).choices[0]
    out_ids = [int(t.removeprefix("token_id:")) for t in first.logprobs.tokens]
    assert tokenizer.decode(out_ids) == first.text == free
    word = tokenizer.decode(out_ids[1:3]).strip()
    banned = client.completions.create(**kw, logprobs=0, extra_body={**as_ids, "bad_words": [word]}).choices[0]
    got = [int(t.removeprefix("token_id:")) for t in banned.logprobs.tokens]
    for variant in (word, " " + word):
        seq = tokenizer.encode(variant, add_special_tokens=False)
        assert all(got[i : i + len(seq)] != seq for i in range(len(got))), (variant, got)
    # allowed_token_ids bounds a chat answer too (its logprobs name the tokens by id).
    allowed = tokenizer.encode(" yes no", add_special_tokens=False)
    chat = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=8, temperature=1.0, seed=1, logprobs=True, top_logprobs=2,
        extra_body={"allowed_token_ids": allowed, **as_ids},
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 8 and {int(e.token.removeprefix("token_id:")) for e in content} <= set(allowed)
    assert all(t.token.startswith("token_id:") for e in content for t in e.top_logprobs)
    cut = client.completions.create(**kw, extra_body={"truncate_prompt_tokens": 2})
    assert cut.usage.prompt_tokens == 2
    chat_cut = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                              extra_body={"truncate_prompt_tokens": 3})  # fmt: skip
    assert chat_cut.usage.prompt_tokens == 3
    # SGLang's spelling on /generate.
    native = httpx.post(server.url + "/generate", json={
        "text": "The quick brown fox", "sampling_params": {"max_new_tokens": 16, "temperature": 0, "stop": [stop],
                                                           "no_stop_trim": True}}, timeout=60)  # fmt: skip
    assert native.json()["text"] == kept.choices[0].text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"cache_salt": "s" * 1025}, "cache_salt"),
    ],
)
def test_bad_filter_values_are_a_400_naming_the_field(server: ServerThread, extra: dict, param: str) -> None:
    body = {"model": MODEL, "messages": USER, "max_tokens": 2, **extra}
    assert_error(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60), 400, param=param)


@pytest.mark.parametrize(
    ("sampling", "param"),
    [
        ({"allowed_token_ids": [1, 10**6]}, "sampling_params.allowed_token_ids"),
        ({"bad_words_ids": [[1]] * 1000}, "sampling_params.bad_words_ids"),
        ({"bad_words_ids": [[1, "x"]]}, "sampling_params"),
    ],
)
def test_native_filters_are_bounded(server: ServerThread, sampling: dict, param: str) -> None:
    """/generate takes the fields as token ids: their sizes are bounded as the OpenAI routes bound words (a
    step's work per request must stay small)."""
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2, **sampling}}
    assert_error(httpx.post(server.url + "/generate", json=body, timeout=60), 400, param=param)


def test_filter_fields_elsewhere_are_refused_not_ignored(server: ServerThread) -> None:
    """The OpenAI routes serve them; Responses and /generate (whose sampling_params take token ids) refuse them
    rather than ignore them. SGLang's top-level priority on /generate is read (a 400 here: the default policy)."""
    for field, value in (("return_tokens_as_token_ids", True), ("allowed_token_ids", [1]), ("bad_words", ["x"])):
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, field: value}
        assert_error(httpx.post(server.url + "/v1/responses", json=body, timeout=60), 400, param=field)
    native = {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "priority": 2}
    assert_error(httpx.post(server.url + "/generate", json=native, timeout=60), 400, param="sampling_params.priority")


def test_prompt_logprobs_as_vllm_gives_them(server: ServerThread, engine: Engine) -> None:
    """Per prompt token (None for the first): its own id with logprob and exact rank, then the best alternatives
    ranked 1..k; the same numbers echo + logprobs gives; the answer's alternatives keep their own count."""
    prompt = "The quick brown fox jumps over the lazy dog"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "logprobs": 1, "prompt_logprobs": 3}
    choice = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    echo = httpx.post(server.url + "/v1/completions", json={**body, "echo": True, "max_tokens": 0}, timeout=60)
    echoed = echo.json()["choices"][0]["logprobs"]["token_logprobs"][: len(ids)]
    for token_id, entry, want in zip(ids[1:], entries[1:], echoed[1:]):
        own = entry[str(token_id)]
        assert own["logprob"] == pytest.approx(want, abs=1e-4) and own["rank"] >= 1
        others = [v for k, v in entry.items() if k != str(token_id) or v["rank"] <= 3]
        assert sorted(v["rank"] for v in others)[:3] == [1, 2, 3] and len(entry) in (3, 4)
        assert own["decoded_token"] == engine.tokenizer.decode([token_id])
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"])  # logprobs=1, not 3
    # n choices: the first scores the prompt, the others take its KV from the cache, and all show its numbers.
    before = engine.server_info()["cache_stats"]["cached_prompt_tokens"]
    fresh = " ".join([prompt] * 4) + " and runs away"  # (not cached yet, and long enough to wait for)
    many = {**body, "prompt": fresh, "n": 3, "temperature": 1.0, "seed": 5, "echo": True}
    got = httpx.post(server.url + "/v1/completions", json=many, timeout=60).json()["choices"]
    n_ids = len(engine.tokenizer.encode(fresh, add_special_tokens=False))
    assert engine.server_info()["cache_stats"]["cached_prompt_tokens"] - before >= 2 * (n_ids - 1)
    assert got[1]["prompt_logprobs"] == got[2]["prompt_logprobs"] == got[0]["prompt_logprobs"]
    assert len(got[0]["prompt_logprobs"]) == n_ids and got[0]["prompt_logprobs"][0] is None
    head = [c["logprobs"]["token_logprobs"][:n_ids] for c in got]
    assert head[0] == head[1] == head[2] and head[0][0] is None
    chat = {"model": MODEL, "messages": USER, "max_tokens": 2, "logprobs": True, "top_logprobs": 1,
            "prompt_logprobs": 2}  # fmt: skip
    resp = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert resp["prompt_logprobs"][0] is None and len(resp["prompt_logprobs"]) == resp["usage"]["prompt_tokens"]
    assert all(len(e["top_logprobs"]) == 1 for e in resp["choices"][0]["logprobs"]["content"])
    streamed = httpx.post(server.url + "/v1/chat/completions", json={**chat, "stream": True}, timeout=60)
    assert_error(streamed, 400, param="prompt_logprobs")
