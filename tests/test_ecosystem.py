"""What a vLLM or SGLang user's first commands expect: model ids from the Hugging Face cache, their flag names, the
model's sampling defaults, open /metrics with --api-key, several served names, request ids, counters that sum."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixserve.runtime.engine import Engine
from radixserve.server import ServerConfig, create_app
from radixserve.server.testing import ServerThread, free_port
from tests.test_server_tiny import USER, assert_error
from tests.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
REPO_ID = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hf_cache(home: Path, model: Path) -> Path:
    """An HF cache under ``home`` holding ``model`` as ``REPO_ID`` at ``main``, laid out as huggingface_hub does."""
    repo = home / "hub" / f"models--{REPO_ID.replace('/', '--')}"
    shutil.copytree(model, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return home


def _serve(args: list[str], env: dict[str, str], port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "radixserve.server.cli", "serve", "--port", str(port), "--device", "cpu", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_ready(proc: subprocess.Popen, port: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{proc.stdout.read()}"  # type: ignore[union-attr]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not become ready")


def _stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    out, _ = proc.communicate(timeout=60)
    return out


def test_a_hub_model_id_is_served_from_the_hf_cache_offline(tiny_model_dir: Path, tmp_path: Path) -> None:
    home = _hf_cache(tmp_path / "hf", tiny_model_dir)
    env = {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    port = free_port()
    proc = _serve(["--model", REPO_ID, "--max-total-tokens", "2048"], env, port)
    try:
        _wait_ready(proc, port)
        resp = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": REPO_ID, "messages": USER, "max_tokens": 4},
            timeout=60,
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == "tiny-llama"  # the id's last part, as with a folder
    finally:
        _stop(proc)

    unknown = _serve(["--model", "nobody/nothing"], env, free_port())
    out, _ = unknown.communicate(timeout=120)
    assert unknown.returncode != 0
    assert "'nobody/nothing'" in out and str(home / "hub") in out and "HF_HUB_OFFLINE" in out, out[-2000:]


def test_vllm_and_sglang_flag_names_map_onto_ours(tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    args = ["--model-path", str(tiny_model_dir), "--context-length", "512", "--tensor-parallel-size", "1",
            "--mem-fraction-static", "0.5", "--served-model-name", "a", "b"]  # fmt: skip
    proc = _serve(args, {}, port)
    try:
        _wait_ready(proc, port)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["a", "b"]
        for name in ("a", "b"):
            body = {"model": name, "prompt": "hi", "max_tokens": 2}
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200 and reply.json()["model"] == "a", reply.text
    finally:
        out = _stop(proc)
    config = json.loads(re.search(r"engine config: (\{.*\})", out).group(1))  # type: ignore[union-attr]
    assert (config["model"], config["max_context_len"], config["tp"]) == (str(tiny_model_dir), 512, 1)
    assert config["mem_fraction_static"] == 0.5
    sized = re.search(
        r"\((0\.50) x (\d+) B total - (\d+) B weights - (\d+) B reserve\) // (\d+) B per token = (\d+) tokens", out
    )
    assert sized, out[-3000:]
    total, weights, reserve, per_token, slots = (int(g) for g in sized.groups()[1:])
    assert slots == (int(total * 0.5) - weights - reserve) // per_token
    meminfo = Path("/proc/meminfo").read_text()
    mem_total = int(re.search(r"MemTotal:\s+(\d+) kB", meminfo).group(1)) * 1024  # type: ignore[union-attr]
    assert total <= mem_total and reserve == 1 << 30
    weight_files = sum(f.stat().st_size for f in tiny_model_dir.glob("*.safetensors"))
    assert weights >= weight_files * 0.9  # the parameters (and any packed copy) are counted
    assert re.search(rf"KV cache: {slots} tokens", out)

    old = _serve(["--model", str(tiny_model_dir), "--mem-fraction", "0.4"], {}, port := free_port())
    try:
        _wait_ready(old, port)
    finally:
        out = _stop(old)
    assert "--mem-fraction is deprecated" in out
    assert json.loads(re.search(r"engine config: (\{.*\})", out).group(1))["mem_fraction_static"] == 0.4  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def greedy_by_default(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_tiny_model(tmp_path_factory.mktemp("tiny-greedy"))
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 2}))
    return folder


@pytest.mark.parametrize("setting", ["auto", "vllm"])
def test_the_models_generation_config_supplies_sampling_defaults(greedy_by_default: Path, setting: str) -> None:
    engine = Engine(model=str(greedy_by_default), device="cpu", max_total_tokens=2048)
    config = ServerConfig(served_model_name="tiny", generation_config=setting)
    try:
        with ServerThread(create_app(engine, config)) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:

            def complete(**extra: object) -> str:
                body = {"model": "tiny", "prompt": "Once upon", "max_tokens": 12, "ignore_eos": True, **extra}
                resp = http.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                return resp.json()["choices"][0]["text"]

            greedy = complete(temperature=0)
            left_out = {complete(seed=s) for s in range(4)}
            sampled = {complete(seed=s, temperature=1.0) for s in range(4)}
            info = http.get("/server_info").json()
    finally:
        engine.shutdown()
    assert len(sampled) > 1  # an explicit temperature is the request's own
    if setting == "auto":
        assert left_out == {greedy}, "do_sample false in generation_config.json: greedy unless asked otherwise"
        assert info["sampling_defaults"] == {"temperature": 0.0}
    else:
        assert len(left_out) > 1, "--generation-config vllm: the server's own default, temperature 1"
        assert info["sampling_defaults"] == {}


def test_a_generation_config_that_fails_to_read_fails_the_start(greedy_by_default: Path, tmp_path: Path) -> None:
    """Read when the engine is ready: a failure there left the server "loading" for ever (and the engine running)."""
    path = tmp_path / "generation_config.json"
    path.write_text("{}")
    config = ServerConfig(served_model_name="tiny", generation_config=str(path))
    path.write_text("{not json")  # broken after the start-up check
    engines: list[Engine] = []

    def factory() -> Engine:
        engines.append(Engine(model=str(greedy_by_default), device="cpu", max_total_tokens=1024))
        return engines[-1]

    app = create_app(factory, config, model=str(greedy_by_default))
    with ServerThread(app) as srv, httpx.Client(base_url=srv.url) as http:
        deadline = time.monotonic() + 30
        while (health := http.get("/health").json())["status"] == "loading":
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert health["status"] == "dead" and "generation_config.json" in json.dumps(health), health
    assert engines and not engines[0].alive
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no generation_config.json"):  # checked at start-up, where it can be
        ServerConfig(generation_config=str(tmp_path / "empty"))


@pytest.fixture(scope="module")
def keyed(tiny_model_dir: Path) -> Iterator[tuple[ServerThread, Engine]]:
    engine = Engine(model=str(tiny_model_dir), device="cpu", max_total_tokens=2048)
    try:
        with ServerThread(create_app(engine, ServerConfig(served_model_name="tiny", api_key="sesame"))) as srv:
            yield srv, engine
    finally:
        engine.shutdown()


def test_the_key_protects_the_api_not_metrics_or_health(keyed: tuple[ServerThread, Engine]) -> None:
    srv, _ = keyed
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        assert_error(http.get("/v1/models"), 401)
        assert_error(http.post("/v1/chat/completions", json={"model": "tiny", "messages": USER}), 401)
        assert_error(http.post("/generate", json={"text": "hi"}), 401)
        key = {"Authorization": "Bearer sesame"}
        assert http.get("/v1/models", headers=key).status_code == 200
        assert http.get("/health").status_code == 200
        # SageMaker's health check (GET or POST) and vLLM's version route are open too.
        assert http.get("/ping").json() == http.post("/ping").json() == {"status": "ready"}
        assert http.get("/version").json()["version"] == importlib.metadata.version("radixserve")
        scrape = http.get("/metrics")
        assert scrape.status_code == 200
        names = {f.name for f in text_string_to_metric_families(scrape.text)}
        assert {"radixserve:prefix_cache_queries", "radixserve:prefix_cache_hits"} <= names


def test_prefix_cache_counters_sum_and_request_ids_come_back(keyed: tuple[ServerThread, Engine]) -> None:
    srv, _ = keyed
    key = {"Authorization": "Bearer sesame"}

    def counters(http: httpx.Client) -> dict[str, float]:
        out = {}
        for family in text_string_to_metric_families(http.get("/metrics").text):
            for sample in family.samples:
                if sample.name in ("radixserve:prefix_cache_queries_total", "radixserve:prefix_cache_hits_total"):
                    out[sample.name] = sample.value
        return out

    with httpx.Client(base_url=srv.url, timeout=60) as http:
        before = counters(http)
        body = {"model": "tiny", "prompt": "The same long prompt, " * 20, "max_tokens": 2}
        for _ in range(2):
            assert http.post("/v1/completions", json=body, headers=key).status_code == 200
        after = counters(http)
        sent = http.post("/v1/completions", json=body, headers={**key, "X-Request-Id": "my-id-42"})
        made = http.post("/v1/completions", json=body, headers=key)
    queries = after["radixserve:prefix_cache_queries_total"] - before["radixserve:prefix_cache_queries_total"]
    hits = after["radixserve:prefix_cache_hits_total"] - before["radixserve:prefix_cache_hits_total"]
    assert queries > 0 and 0 < hits < queries  # the second request hit most of the first's prompt
    assert sent.headers["x-request-id"] == "my-id-42"
    assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])


def test_json_logs_carry_the_request_id(tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    proc = _serve(["--model", str(tiny_model_dir), "--log-format", "json", "--max-total-tokens", "1024"], {}, port)
    try:
        _wait_ready(proc, port)
        httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"prompt": "hi", "max_tokens": 2},
            headers={"X-Request-Id": "trace-7"},
            timeout=60,
        )
    finally:
        out = _stop(proc)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert lines and all({"time", "level", "logger", "message"} <= set(e) for e in lines)
    assert any(e.get("request_id") == "trace-7" for e in lines), [e for e in lines if "completions" in e["message"]]
