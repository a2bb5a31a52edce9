"""The KV tier (``--enable-hierarchical-cache``): KV evicted from the pool comes back from files, a restart starts
warm, files that are cut short, corrupt, unfinished or another model's are skipped with a log line, and the KV
accounting and the tier's size bound hold. Outputs are compared with their log-probabilities, which any wrong
value in the loaded KV would move."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from radixserve.runtime.config import EngineConfig
from radixserve.runtime.engine import Engine
from radixserve.runtime.kv_pool import KVPool
from radixserve.runtime.kv_tier import KVTier, TierConfig, chain_keys
from radixserve.runtime.kv_tier_file import ChunkError, read_chunk, write_chunk
from radixserve.runtime.request import Req
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.server.testing import free_port, reap, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 16
PARAMS = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "return_logprob": True}


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(length)] for _ in range(n)]


def _engine(model: Path, tier_dir: Path | None, **overrides: Any) -> Engine:
    options: dict[str, Any] = {"max_total_tokens": 450, "chunked_prefill_size": 64, "dtype": "float32"}
    if tier_dir is not None:
        options.update(enable_hierarchical_cache=True, hicache_dir=str(tier_dir), hicache_chunk_tokens=CHUNK)
    options.update(overrides)
    return Engine(model=str(model), device="cpu", **options)


def _run(engine: Engine, prompt: list[int]) -> tuple[list[int], list[float], int]:
    out = engine.generate(input_ids=prompt, sampling_params=PARAMS)
    meta = out["meta_info"]
    return out["output_ids"], [lp.logprob for lp in meta["output_token_logprobs"]], meta["cached_tokens"]


def _serve_once(model: Path, tier_dir: Path, prompt: list[int], **overrides: Any) -> tuple[tuple, dict[str, Any]]:
    """A fresh engine on the tier folder answers ``prompt`` and stops (saving its radix cache): the output and the
    tier's counters."""
    engine = _engine(model, tier_dir, **overrides)
    try:
        out = _run(engine, prompt)
        info = engine.server_info()["kv_tier"]
        engine.check_kv()
    finally:
        engine.shutdown()
    return out, info


def _same(a: tuple[list[int], list[float], int], b: tuple[list[int], list[float], int]) -> None:
    assert a[0] == b[0]
    assert a[1] == pytest.approx(b[1], abs=1e-5)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> dict[int, tuple[list[int], list[float], int]]:
    """Each prompt's output computed from scratch (no radix cache, no tier)."""
    engine = _engine(tiny_model_dir, None, disable_radix_cache=True)
    try:
        return {i: _run(engine, p) for i, p in enumerate(_prompts(5, 200))}
    finally:
        engine.shutdown()


def test_evicted_prefix_is_loaded_back(tiny_model_dir: Path, tmp_path: Path, reference: dict) -> None:
    prompts = _prompts(5, 200)
    engine = _engine(tiny_model_dir, tmp_path)
    try:
        for i in range(4):  # the pool holds two prompts: A is evicted (and saved) by the third
            _same(_run(engine, prompts[i]), reference[i])
        again = _run(engine, prompts[0])
        info = engine.server_info()["kv_tier"]
        engine.check_kv()
    finally:
        engine.shutdown()
    _same(again, reference[0])
    assert again[2] == 192, "every whole chunk of the 199 prompt tokens before the last comes from the tier"
    assert info["hit_tokens"] >= 192 and info["loads"] >= 1 and info["chunks_written"] > 0
    assert info["files_skipped"] == 0


def test_restart_starts_warm(tiny_model_dir: Path, tmp_path: Path, reference: dict) -> None:
    prompts = _prompts(5, 200)
    first = _engine(tiny_model_dir, tmp_path)
    _same(_run(first, prompts[1]), reference[1])
    first.shutdown()  # saves the radix cache
    second = _engine(tiny_model_dir, tmp_path)
    try:
        warm = _run(second, prompts[1])
        info = second.server_info()["kv_tier"]
    finally:
        second.shutdown()
    _same(warm, reference[1])
    assert warm[2] == 192 and info["hit_tokens"] == 192 and info["stored_chunks"] >= 12
    assert info["prefetch_reads"] == 12, "the files were read ahead when the request arrived"


def _chunk_files(tier_dir: Path) -> list[Path]:
    (folder,) = [p for p in tier_dir.iterdir() if p.is_dir()]
    return sorted(folder.glob("*.kv"))


def test_bad_files_are_skipped(
    tiny_model_dir: Path, tmp_path: Path, reference: dict, caplog: pytest.LogCaptureFixture
) -> None:
    prompts = _prompts(5, 200)
    first = _engine(tiny_model_dir, tmp_path)
    _run(first, prompts[2])
    first.shutdown()
    files = _chunk_files(tmp_path)
    assert len(files) == 12
    tier_dir = files[0].parent
    order = chain_keys(tier_dir.name, prompts[2], CHUNK)  # which file holds which chunk
    assert sorted(order) == [f.stem for f in files]
    # Chunk 5 cut short, chunk 3 with a flipped byte: loading stops at chunk 3 and serves chunks 0-2.
    path5, path3 = tier_dir / f"{order[5]}.kv", tier_dir / f"{order[3]}.kv"
    path5.write_bytes(path5.read_bytes()[:-100])
    raw = bytearray(path3.read_bytes())
    raw[-50] ^= 0xFF
    path3.write_bytes(bytes(raw))
    (tier_dir / f"{order[7]}.kv.999.tmp").write_bytes(b"half a write")
    caplog.set_level(logging.INFO, logger="radixserve.kv_tier")
    out, info = _serve_once(tiny_model_dir, tmp_path, prompts[2])
    _same(out, reference[2])
    assert out[2] == 3 * CHUNK
    assert info["files_skipped"] == 1
    log = caplog.text
    assert "removed 1 unfinished chunk writes" in log
    assert "checksum mismatch" in log
    # The bad file was deleted, and the chunk computed again was saved under its name at shutdown.
    shape = (2, 2, 2, CHUNK, 16)
    read_chunk(path3, tier_dir.name, order[3], prompts[2][3 * CHUNK : 4 * CHUNK], shape, torch.float32)


def test_another_models_files_are_never_served(
    tiny_model_dir: Path, tmp_path: Path, reference: dict, caplog: pytest.LogCaptureFixture
) -> None:
    """Files written under one dtype, moved into the folder of another: skipped for their key, output correct."""
    prompts = _prompts(5, 200)
    first = _engine(tiny_model_dir, tmp_path, dtype="bfloat16")
    _run(first, prompts[3])
    first.shutdown()
    (bf16_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    second = _engine(tiny_model_dir, tmp_path)  # float32: another model key, another folder
    f32_dir = second.core.cache.tier.dir
    second.shutdown()
    assert f32_dir != bf16_dir
    # As if misplaced: the bfloat16 run's chunks under the names the float32 run looks up.
    for theirs, ours in zip(chain_keys(bf16_dir.name, prompts[3], CHUNK), chain_keys(f32_dir.name, prompts[3], CHUNK)):
        (f32_dir / f"{ours}.kv").write_bytes((bf16_dir / f"{theirs}.kv").read_bytes())
    caplog.set_level(logging.INFO, logger="radixserve.kv_tier")
    out, info = _serve_once(tiny_model_dir, tmp_path, prompts[3])
    _same(out, reference[3])
    assert out[2] == 0 and info["files_skipped"] == 1
    assert "written for another model" in caplog.text


def test_size_bound_and_accounting(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXSERVE_CHECK_INTEGRITY", "1")  # KV accounting and tier bound after every step
    chunk_bytes = 2 * 2 * 2 * CHUNK * 16 * 4  # layers, K/V, KV heads, tokens, head size, float32
    bound = 20 * (chunk_bytes + 400)  # about 20 chunk files (each has a header)
    engine = _engine(tiny_model_dir, tmp_path, hicache_size=bound / 2**30, max_running_requests=4)
    try:

        def drive(core: Any) -> dict[str, Any]:
            rng = random.Random(3)
            shared = [rng.randrange(3, 200) for _ in range(64)]
            for i in range(30):
                head = shared[: rng.choice([0, 32, 64])]
                prompt = head + [rng.randrange(3, 200) for _ in range(rng.randint(20, 150))]
                core.add(Req(f"r{i}", prompt, SamplingParams(max_new_tokens=rng.randint(1, 12), ignore_eos=True)))
                for _ in range(rng.randint(0, 4)):
                    core.step()
                if i % 7 == 3:
                    core.abort(f"r{i}")
            while core.has_work():
                core.step()
            core.cache.check(core.scheduler.holders())
            core.cache.tier.drain(10)
            core.cache.tier.check()
            return core.cache.tier.info()

        info = engine.call(drive, timeout=300)
        folder = engine.core.cache.tier.dir
    finally:
        engine.shutdown()
    assert info["chunks_written"] > 20, "more was written than the bound holds"
    assert info["stored_bytes"] <= bound
    on_disk = sum(p.stat().st_size for p in folder.glob("*.kv"))
    assert on_disk <= bound


def test_chunk_file_checks(tmp_path: Path) -> None:
    kv = torch.randn(2, 2, 2, CHUNK, 16)
    path = tmp_path / "k.kv"
    write_chunk(path, "model", "k", list(range(CHUNK)), kv)
    assert torch.equal(read_chunk(path, "model", "k", list(range(CHUNK)), tuple(kv.shape), torch.float32), kv)
    cases = {
        "another model": ("other", "k", list(range(CHUNK)), torch.float32),
        "another prefix": ("model", "k", list(range(1, CHUNK + 1)), torch.float32),
        "dtype": ("model", "k", list(range(CHUNK)), torch.bfloat16),
    }
    for name, (model, key, tokens, dtype) in cases.items():
        with pytest.raises(ChunkError):
            read_chunk(path, model, key, tokens, tuple(kv.shape), dtype)
        assert name
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(ChunkError, match="truncated"):
        read_chunk(path, "model", "k", list(range(CHUNK)), tuple(kv.shape), torch.float32)
    with pytest.raises(ChunkError, match="gone"):
        read_chunk(tmp_path / "missing.kv", "model", "k", list(range(CHUNK)), tuple(kv.shape), torch.float32)


def test_a_chunk_saved_again_is_not_lost_to_a_stale_failure(tmp_path: Path) -> None:
    """A read-ahead that failed (its file was evicted, then the chunk saved again) used to delete the new file at
    load."""
    pool = KVPool(4 * CHUNK, 2, 2, 16, torch.float32, torch.device("cpu"))
    pool._kv.copy_(torch.randn_like(pool._kv))
    tier = KVTier(TierConfig(tmp_path, 1 << 20, CHUNK, "m"), pool)
    try:
        tokens, slots = list(range(CHUNK)), list(range(CHUNK))
        key = tier.keys(tokens)[0]
        want = pool._kv[:, :, :, :CHUNK].clone()
        assert tier.save(key, 0, tokens, slots) and tier.drain(10)
        real_read = tier._read

        def stale(*_: object) -> torch.Tensor:
            raise ChunkError("gone (read before the chunk was written again)")

        tier._read = stale  # type: ignore[method-assign]
        assert tier.prefetch([key], tokens, 0) == 1
        tier._reader.submit(lambda: None).result()  # the read-ahead has failed
        tier._read = real_read  # type: ignore[method-assign]
        into = list(range(2 * CHUNK, 3 * CHUNK))
        assert tier.load([key], tokens, 0, 0, into) == CHUNK
        assert torch.equal(pool._kv[:, :, :, 2 * CHUNK : 3 * CHUNK], want)
        assert tier.info()["files_skipped"] == 0 and tier.has(key) and (tier.dir / f"{key}.kv").is_file()
        tier.check()
    finally:
        tier.close()


def test_kill_during_write_keeps_the_previous_state(
    tiny_model_dir: Path, tmp_path: Path, reference: dict, caplog: pytest.LogCaptureFixture
) -> None:
    """A writer killed with SIGKILL in the middle of rewriting a chunk leaves the chunk's previous file as it was
    and a temporary file; the next server deletes the latter (with a log line) and serves the prefix warm."""
    prompts = _prompts(5, 200)
    first = _engine(tiny_model_dir, tmp_path)
    _run(first, prompts[4])
    first.shutdown()
    folder = _chunk_files(tmp_path)[0].parent
    key = chain_keys(folder.name, prompts[4], CHUNK)[5]
    before = (folder / f"{key}.kv").read_bytes()
    script = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from radixserve.runtime.kv_tier_file import write_chunk\n"
        "kv = torch.zeros(256, 2**20)  # 1 GiB: the write takes a while\n"
        "print('writing', flush=True)\n"
        "write_chunk(Path(sys.argv[1]) / (sys.argv[3] + '.kv'), sys.argv[2], sys.argv[3], [1], kv)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", script, str(folder), folder.name, key]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        deadline = time.monotonic() + 60
        while not any(folder.glob("*.tmp")) or next(folder.glob("*.tmp")).stat().st_size < 2**20:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        if proc.stdout:
            proc.stdout.close()
    assert (folder / f"{key}.kv").read_bytes() == before and len(list(folder.glob("*.tmp"))) == 1
    caplog.set_level(logging.INFO, logger="radixserve.kv_tier")
    out, info = _serve_once(tiny_model_dir, tmp_path, prompts[4])
    _same(out, reference[4])
    assert out[2] == 192 and info["files_skipped"] == 0
    assert "removed 1 unfinished chunk writes" in caplog.text
    assert not list(folder.glob("*.tmp"))


def test_one_process_per_folder(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = _engine(tiny_model_dir, tmp_path)
    try:
        with pytest.raises(ValueError, match="own --hicache-dir"):
            _engine(tiny_model_dir, tmp_path)
    finally:
        engine.shutdown()


def test_dummy_weights_have_a_tier_of_their_own(tiny_model_dir: Path, tmp_path: Path, reference: dict) -> None:
    """--load-format dummy reads the folder's config but none of its weights: its KV must never be served to the
    model's real weights (they shared a key, and the real model answered from random weights' KV)."""
    prompt = _prompts(5, 200)[3]
    _serve_once(tiny_model_dir, tmp_path, prompt, load_format="dummy")
    out, _ = _serve_once(tiny_model_dir, tmp_path, prompt)
    _same(out, reference[3])
    assert out[2] == 0  # nothing cached for these weights


def test_an_unusable_folder_is_a_config_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ValueError, match="--hicache-dir .* cannot hold the KV tier"):
        _engine(tiny_model_dir, tmp_path / "file" / "kv")


def test_config_refusals() -> None:
    with pytest.raises(ValueError, match="radix cache"):
        EngineConfig(enable_hierarchical_cache=True, disable_radix_cache=True)
    with pytest.raises(ValueError, match="hicache-chunk-tokens"):
        EngineConfig(hicache_chunk_tokens=8)
    with pytest.raises(ValueError, match="hicache-size"):
        EngineConfig(hicache_size=0)


def test_sigterm_then_restart_serves_warm(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The CLI: SIGTERM saves the radix cache; the next server on the same folder reports the prompt as cached
    (usage.prompt_tokens_details.cached_tokens), gives the same greedy output, and /metrics counts the tier."""
    prompt = " ".join(f"word{i % 37} and line {i}." for i in range(60))
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    results = []
    for _ in range(2):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "radixserve.server.cli", "serve", "--model", str(tiny_model_dir), "--device"]
        cmd += ["cpu", "--port", str(port), "--max-total-tokens", "4096", "--enable-hierarchical-cache"]
        cmd += ["--hicache-dir", str(tmp_path), "--hicache-chunk-tokens", str(CHUNK)]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_healthy(proc, url)
            resp = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
            metrics = httpx.get(url + "/metrics", timeout=10).text
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
            log = proc.stdout.read() if proc.stdout else ""
        finally:
            reap(proc)
        assert "radix cache saved" in log, log[-2000:]
        results.append((resp, metrics))
    (cold, _), (warm, metrics) = results
    prompt_tokens = cold["usage"]["prompt_tokens"]
    assert (cold["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // CHUNK * CHUNK
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert warm["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        cold["choices"][0]["logprobs"]["token_logprobs"], abs=1e-5
    )
    hits = [ln for ln in metrics.splitlines() if ln.startswith("radixserve:kv_tier_hit_tokens_total")]
    assert hits and float(hits[0].split()[-1]) == (prompt_tokens - 1) // CHUNK * CHUNK


def test_a_failing_disk_loses_chunks_not_the_engine(
    tiny_model_dir: Path, tmp_path: Path, reference: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every write failing (a full disk): the chunks are not kept, counted, and the engine serves on."""
    import radixserve.runtime.kv_tier as kv_tier

    def full_disk(*args: Any) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kv_tier, "write_chunk", full_disk)
    prompts = _prompts(5, 200)
    engine = _engine(tiny_model_dir, tmp_path)
    try:
        for i in (0, 1, 2, 0):
            _same(_run(engine, prompts[i]), reference[i])
        engine.core.cache.tier.drain(10)
        info = engine.server_info()["kv_tier"]
        engine.check_kv()
    finally:
        engine.shutdown()
    assert info["write_errors"] > 0 and info["chunks_written"] == 0 and info["stored_chunks"] == 0
    assert info["pending_bytes"] == 0
