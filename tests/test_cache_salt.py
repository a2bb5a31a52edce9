"""vLLM's ``cache_salt``: requests share cached prefixes only with requests of the same salt, so one tenant can
neither reuse another's KV nor time it; the KV accounting holds, and a salted request's KV stays out of the tier
on disk (its files are keyed by tokens alone)."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixserve.runtime.engine import Engine
from radixserve.runtime.request import SALTED_IDS, salt_offset
from radixserve.server import ServerConfig, create_app
from radixserve.server.testing import ServerThread
from tests.test_server_tiny import MODEL, assert_error

PARAMS = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


def _generate(engine: Engine, prompt: list[int], salt: str | None = None) -> tuple[list[int], int]:
    out = engine.generate(input_ids=prompt, sampling_params={**PARAMS, "cache_salt": salt})
    return out["output_ids"], out["meta_info"]["cached_tokens"]


def test_prefixes_are_shared_within_a_salt_only(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXSERVE_CHECK_INTEGRITY", "1")
    rng = random.Random(0)
    prompt = [rng.randrange(3, 200) for _ in range(96)]
    engine = Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=2048, dtype="float32")
    try:
        plain, cached = _generate(engine, prompt)
        assert cached == 0
        assert _generate(engine, prompt)[1] >= 90  # unsalted: the usual hit
        out, cached = _generate(engine, prompt, "tenant-a")
        assert (out, cached) == (plain, 0)  # not the unsalted copy
        assert _generate(engine, prompt, "tenant-a")[1] >= 90  # its own copy
        assert _generate(engine, prompt, "tenant-b")[1] == 0
        # A longer prompt of tenant b reuses b's prefix only.
        assert _generate(engine, prompt + [5, 6, 7], "tenant-b")[1] >= 90
        engine.check_kv()
    finally:
        engine.shutdown()


def test_a_salted_prefix_is_not_written_to_the_tier(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Evicted from a small pool, salted prefixes are dropped, unsalted ones saved."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 200) for _ in range(80)] for _ in range(8)]
    options: dict[str, Any] = {"max_total_tokens": 450, "dtype": "float32", "enable_hierarchical_cache": True,
                               "hicache_dir": str(tmp_path), "hicache_chunk_tokens": 16}  # fmt: skip
    engine = Engine(model=str(tiny_model_dir), device="cpu", **options)
    try:
        for prompt in prompts:
            _generate(engine, prompt, "tenant-a")
        info = engine.server_info()
        assert info["cache_stats"]["evicted_tokens"] > 0, info["cache_stats"]
        assert info["kv_tier"]["chunks_written"] == info["kv_tier"]["pending_bytes"] == 0
        for prompt in prompts:
            _generate(engine, prompt)
        deadline = time.monotonic() + 30
        while engine.server_info()["kv_tier"]["chunks_written"] == 0:
            assert time.monotonic() < deadline, "unsalted prefixes were never saved"
            time.sleep(0.05)
        engine.check_kv()
    finally:
        engine.shutdown()


def test_salted_ids_never_meet_token_ids() -> None:
    for namespace in (("a", None), ("b", None), ("x" * 200, None), (None, "adapter"), ("a", "adapter")):
        assert salt_offset(namespace) >= SALTED_IDS and salt_offset(namespace) % SALTED_IDS == 0
    assert salt_offset(("a", None)) != salt_offset(("b", None))
    # No salt names an adapter's namespace (the salt is any string a client sends).
    assert salt_offset(("\x00lora:adapter", None)) != salt_offset((None, "adapter"))
    assert salt_offset(("a", "adapter")) not in (salt_offset(("a", None)), salt_offset((None, "adapter")))


def test_cache_salt_over_http(tiny_model_dir: Path) -> None:
    engine = Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=2048)
    body = {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog. " * 4, "max_tokens": 2}
    try:
        with ServerThread(create_app(engine, ServerConfig(served_model_name=MODEL))) as srv:

            def cached(url: str, **extra: Any) -> int:
                resp = httpx.post(srv.url + url, json={**body, **extra}, timeout=60)
                assert resp.status_code == 200, resp.text
                return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

            assert cached("/v1/completions", cache_salt="s1") == 0
            assert cached("/v1/completions", cache_salt="s1") > 0
            assert cached("/v1/completions", cache_salt="s2") == 0
            assert cached("/v1/completions") == 0
            chat = {"messages": [{"role": "user", "content": body["prompt"]}], "prompt": None}
            assert cached("/v1/chat/completions", cache_salt="s3", **chat) == 0
            assert cached("/v1/chat/completions", cache_salt="s3", **chat) > 0
            resp = httpx.post(srv.url + "/v1/completions", json={**body, "cache_salt": ""}, timeout=60)
            assert_error(resp, 400, param="cache_salt")
    finally:
        engine.shutdown()
