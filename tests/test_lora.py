"""LoRA adapters (``--lora-modules``) against PEFT's own model on the same weights: greedy tokens at float32.

Adapters are made by PEFT itself (``init_lora_weights=False`` draws B at random, so each adapter changes the
output) and saved in its format; the engine must load them as PEFT runs them, per request, with rows of other
adapters and of the base model in the same step, and keep each adapter's cached KV apart.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from radixserve.runtime.config import EngineConfig, add_arguments, from_args
from radixserve.runtime.cpu_ext import load_kernels
from radixserve.runtime.engine import Engine
from radixserve.runtime.engine_process import EngineProcess
from radixserve.runtime.lora import LoRAAdapter, LoRABatch, load_adapter
from radixserve.runtime.lora_spec import LoRASpec, parse_lora_modules
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.server import ServerConfig, create_app
from radixserve.server.testing import ServerThread

MAX_NEW = 12
PROMPTS = [[5, 17, 42, 99, 7, 3], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [250, 3, 77]]
ADAPTERS = {
    # Every projection, rank 8.
    "every": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"]),  # fmt: skip
    # Some parts of the merged projections only, rsLoRA scaling, and a per-module alpha.
    "some": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], use_rslora=True,
                 alpha_pattern={"up_proj": 2}),  # fmt: skip
}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for seed, (name, options) in enumerate(ADAPTERS.items()):
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = get_peft_model(base, LoraConfig(init_lora_weights=False, **options))
        out[name] = tmp_path_factory.mktemp(f"lora-{name}")
        model.save_pretrained(str(out[name]))
    return out


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, adapters: dict[str, Path]) -> Iterator[Engine]:
    modules = tuple(f"{name}={path}" for name, path in adapters.items())
    eng = Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=4096, lora_modules=modules)
    try:
        yield eng
    finally:
        eng.shutdown()


@torch.inference_mode()
def _peft_greedy(tiny_model_dir: Path, adapter: Path | None, prompt: list[int]) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _params(lora: str | None) -> SamplingParams:
    return SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True, lora_name=lora)


def test_each_adapter_decodes_as_peft_and_they_share_a_batch(
    engine: Engine, tiny_model_dir: Path, adapters: dict[str, Path]
) -> None:
    names = [None, "every", "some"]
    want = {(n, i): _peft_greedy(tiny_model_dir, adapters[n] if n else None, p) for n in names
            for i, p in enumerate(PROMPTS)}  # fmt: skip
    assert want[("every", 0)] != want[(None, 0)] and want[("some", 0)] != want[(None, 0)]  # the adapters act
    # One at a time, then all nine together (prefill and decode steps that mix adapters and the base model).
    for (name, i), tokens in want.items():
        assert engine.generate(input_ids=PROMPTS[i], sampling_params=_params(name))["output_ids"] == tokens
    keys = list(want)
    together = engine.generate(input_ids=[PROMPTS[i] for _, i in keys], sampling_params=[_params(n) for n, _ in keys])
    assert [r["output_ids"] for r in together] == [want[k] for k in keys]
    engine.check_kv()


def test_an_adapter_never_reads_another_ones_cached_prefix(engine: Engine) -> None:
    prompt = list(range(40, 90))
    first = engine.generate(input_ids=prompt, sampling_params=_params("every"))
    again = engine.generate(input_ids=prompt, sampling_params=_params("every"))
    assert again["meta_info"]["cached_tokens"] == len(prompt) - 1
    for other in (None, "some"):
        res = engine.generate(input_ids=prompt, sampling_params=_params(other))
        assert res["meta_info"]["cached_tokens"] == 0, other
    assert again["output_ids"] == first["output_ids"]


def test_unknown_adapters_and_bad_folders_are_clear_errors(
    engine: Engine, tmp_path: Path, tiny_model_dir: Path
) -> None:
    with pytest.raises(ValueError, match="no LoRA adapter is named 'nope'.*every, some"):
        engine.generate(input_ids=PROMPTS[0], sampling_params=_params("nope"))
    with pytest.raises(ValueError, match="expected NAME=PATH"):
        parse_lora_modules(["just-a-path"])
    with pytest.raises(ValueError, match="given twice"):
        parse_lora_modules(["a=/x", "a=/y"])
    with pytest.raises(ValueError, match="no adapter_config.json"):
        Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=512, lora_modules=(f"x={tmp_path}",))


def test_a_client_picks_an_adapter_by_its_model_name(engine: Engine) -> None:
    """As vLLM serves them: each adapter is a model of its own in /v1/models (its parent the base model), and the
    OpenAI ``model`` field (SGLang's ``lora_path`` on /generate) runs a request with it."""
    with ServerThread(create_app(engine, ServerConfig(served_model_name="tiny"))) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"tiny", "every", "some"}
        assert cards["every"].parent == "tiny" and cards["tiny"].parent is None
        assert client.models.retrieve("some").id == "some"
        for name in (None, "every", "some"):
            want = engine.generate(input_ids=PROMPTS[0], sampling_params=_params(name))["output_ids"]
            got = client.completions.create(
                model=name or "tiny", prompt=PROMPTS[0], max_tokens=MAX_NEW, temperature=0,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, logprobs=0,
            )  # fmt: skip
            assert got.model == (name or "tiny")
            assert [int(t.split(":")[1]) for t in got.choices[0].logprobs.tokens] == want
            native = httpx.post(
                srv.url + "/generate",
                json={"input_ids": PROMPTS[0], "lora_path": name, "sampling_params": _native()},
            ).json()
            assert native["output_ids"] == want
        chat = client.chat.completions.create(
            model="every", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
        )
        assert chat.model == "every"
        with pytest.raises(openai.NotFoundError) as err:
            client.completions.create(model="nope", prompt="x", max_tokens=2)
        assert "'every', 'some'" in err.value.body["message"]
        bad = httpx.post(srv.url + "/generate", json={"text": "x", "lora_path": "nope", "sampling_params": _native()})
        assert bad.status_code == 400 and "no LoRA adapter is named 'nope'" in bad.json()["error"]["message"]


def _native() -> dict:
    return {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


def test_an_update_has_the_same_bits_whichever_rows_share_its_group() -> None:
    """Rows of one adapter that are contiguous in a step, interleaved with other rows, or the whole step get the
    same numbers: each path rounds the float32 update into the bfloat16 output once."""
    gen = torch.Generator().manual_seed(0)
    at, bt = torch.randn(64, 8, generator=gen), torch.randn(8, 96, generator=gen)
    adapter = LoRAAdapter("a", "/x", 8, {(0, "o_proj"): (at, bt)})
    x = torch.randn(6, 64, generator=gen).bfloat16()
    y = torch.randn(6, 96, generator=gen).bfloat16()
    whole = LoRABatch([(adapter, None)]).apply(0, "o_proj", x, y.clone())
    part = LoRABatch([(adapter, slice(2, 4))]).apply(0, "o_proj", x, y.clone())
    picked = LoRABatch([(adapter, torch.tensor([2, 3]))]).apply(0, "o_proj", x, y.clone())
    assert torch.equal(part, picked) and torch.equal(part[2:4], whole[2:4]) and torch.equal(part[:2], y[:2])


def test_adapter_names_and_flags_are_checked_where_they_are_given(
    engine: Engine, adapters: dict[str, Path], tmp_path: Path
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    ns = parser.parse_args(["--lora-modules", "a=/x", "--lora-modules", "b=/y", "c=/z"])  # repeated: all kept
    assert from_args(EngineConfig, ns).lora_modules == ("a=/x", "b=/y", "c=/z")
    with pytest.raises(ValueError, match="given twice"):
        parse_lora_modules(["a=/x", " a =/y"])
    with pytest.raises(ValueError, match="is a name of the base model"):  # a request could not name either
        create_app(engine, ServerConfig(served_model_name="every"))
    # An adapter whose base weights PiSSA changed is refused, not served as if it were plain LoRA.
    folder = tmp_path / "pissa"
    shutil.copytree(adapters["every"], folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "init_lora_weights": "pissa"}))
    with pytest.raises(ValueError, match="pissa"):
        load_adapter(LoRASpec("p", str(folder)), engine.core.runner.model, torch.float32, torch.device("cpu"))


def test_adapters_are_loaded_and_unloaded_while_serving(
    engine: Engine, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (with --allow-runtime-lora-updating). An adapter
    loaded again under a name is served with its new weights: the cached KV of the one it replaced is never hit."""
    prompt = list(range(100, 140))
    want = {n: engine.generate(input_ids=prompt, sampling_params=_params(n))["output_ids"] for n in ("every", "some")}
    with ServerThread(create_app(engine, ServerConfig(served_model_name="tiny"))) as srv:
        off = httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapters["some"])})
        assert off.status_code == 400 and off.json()["error"]["code"] == "lora_updating_disabled"
    config = ServerConfig(served_model_name="tiny", allow_runtime_lora_updating=True)
    with ServerThread(create_app(engine, config)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)

        def load(name: str, path: Path | str) -> httpx.Response:
            return httpx.post(srv.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})

        def run(name: str) -> tuple[list[int], int]:
            got = client.completions.create(
                model=name, prompt=prompt, max_tokens=MAX_NEW, temperature=0, logprobs=0,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
            )  # fmt: skip
            ids = [int(t.split(":")[1]) for t in got.choices[0].logprobs.tokens]
            return ids, got.usage.prompt_tokens_details.cached_tokens

        assert load("x", adapters["some"]).text == "Success: LoRA adapter 'x' added successfully."
        assert "x" in {m.id for m in client.models.list().data}
        assert httpx.get(srv.url + "/server_info").json()["lora_adapters"] == ["every", "some", "x"]
        assert run("x") == (want["some"], 0)  # its own cache namespace, not "some"'s
        assert run("x")[1] == len(prompt) - 1
        assert httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 200
        with pytest.raises(openai.NotFoundError):
            run("x")
        assert load("x", adapters["every"]).status_code == 200
        assert run("x") == (want["every"], 0)  # the new weights, not the old adapter's cached KV
        unload_missing = httpx.post(srv.url + "/unload_lora_adapter", json={"lora_name": "nope"})  # (SGLang's path)
        broken = tmp_path / "broken"
        shutil.copytree(adapters["every"], broken)
        (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
        bad = [(load("x", adapters["every"]), 400, "lora_name"), (load("tiny", adapters["every"]), 400, "lora_name"),
               (load("  ", adapters["every"]), 400, "lora_name"), (load("y", "/nonexistent"), 400, "lora_path"),
               (load("y", broken), 400, "lora_path"), (unload_missing, 404, "lora_name")]  # fmt: skip
        for resp, status, param in bad:
            assert resp.status_code == status and resp.json()["error"]["param"] == param, resp.text
        # An adapter in use is not unloaded.
        long = SamplingParams(max_new_tokens=4000, ignore_eos=True, lora_name="x")
        rid = engine.submit(prompt, long, lambda out: None)
        busy = httpx.post(srv.url + "/v1/unload_lora_adapter", json={"lora_name": "x"})
        assert busy.status_code == 409 and "in use" in busy.json()["error"]["message"]
        engine.abort(rid)
    engine.unload_lora("x")


def test_an_engine_process_loads_adapters_too(tiny_model_dir: Path, adapters: dict[str, Path], engine: Engine) -> None:
    want = engine.generate(input_ids=PROMPTS[1], sampling_params=_params("every"))["output_ids"]
    proc = EngineProcess(model=str(tiny_model_dir), device="cpu", dtype="float32", max_total_tokens=2048)
    try:
        proc.load_lora("late", str(adapters["every"]))
        assert proc.lora_names == ("late",)
        assert proc.generate(input_ids=PROMPTS[1], sampling_params=_params("late"))["output_ids"] == want
        proc.unload_lora("late")
        with pytest.raises(ValueError, match="no LoRA adapter is named 'late'"):
            proc.generate(input_ids=PROMPTS[1], sampling_params=_params("late"))
        with pytest.raises(LookupError):
            proc.unload_lora("late")
    finally:
        proc.shutdown()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_row_kernel_matches_the_matmuls_and_ignores_its_neighbours(dtype: torch.dtype) -> None:
    """``csrc/lora_ops.cpp`` against the reference products (float64 here), and each row's bits the same whichever
    rows are updated with it."""
    kernels = load_kernels()
    if kernels is None:
        pytest.skip("no compiled kernels on this machine")
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(9, 96, generator=gen).to(dtype), torch.randn(9, 200, generator=gen).to(dtype)
    at, bt = torch.randn(96, 24, generator=gen), torch.randn(24, 200, generator=gen) * 0.1
    want = (y.double() + x.double() @ at.double() @ bt.double()).to(dtype)
    every = y.clone()
    kernels.lora.add_update(every, x, at, bt, 0, 9, torch.empty(0, dtype=torch.long))
    torch.testing.assert_close(every, want, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-4)
    some = y.clone()
    kernels.lora.add_update(some, x, at, bt, 0, 0, torch.tensor([7, 2]))
    others = [0, 1, 3, 4, 5, 6, 8]
    assert torch.equal(some[[2, 7]], every[[2, 7]]) and torch.equal(some[others], y[others])
    with pytest.raises(RuntimeError, match="row out of range"):
        kernels.lora.add_update(y.clone(), x, at, bt, 0, 0, torch.tensor([9]))
