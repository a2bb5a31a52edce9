"""Tensor parallelism over gloo on CPU: ``--tp 2`` gives the same greedy tokens as ``--tp 1`` (engine, HTTP server,
two "nodes" on loopback, the real model with ``--tp 3``), and a dead worker stops the engine cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from radixserve.constrained import ConstraintSpec
from radixserve.runtime.engine import Engine
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.server import ServerConfig, create_app
from radixserve.server.testing import ServerThread, free_port

ROOT = Path(__file__).resolve().parent.parent
SHARED = "You are a careful assistant. Answer briefly and precisely, and show your reasoning step by step. " * 6
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    SHARED + "Question: what is two plus two?",
    SHARED + "Question: name a prime number.",
    SHARED + "Question: which planet is red?",
    "1, 2, 3, 4, 5, 6, 7,",
]


def greedy(n: int = 16, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, **kw)


def make_engine(model: Path | str, tp: int, **kw) -> Engine:
    return Engine(model=str(model), device="cpu", max_total_tokens=4096, chunked_prefill_size=64, tp=tp, **kw)


def run_workload(engine: Engine) -> list[dict]:
    """Chunked prefills, a shared prefix (radix hits, cascade decode), a constrained request, prompt logprobs."""
    params = [greedy() for _ in PROMPTS]
    params[1] = greedy(constraint=ConstraintSpec("regex", "[a-z ]{4,30}"))
    params[5] = greedy(return_logprob=True, logprob_start_len=0)
    first = engine.generate(PROMPTS[:3], params[:3])
    return first + engine.generate(PROMPTS[3:], params[3:])  # these hit the cached shared prefix


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> list[dict]:
    engine = make_engine(tiny_model_dir, 1)
    try:
        return run_workload(engine)
    finally:
        engine.shutdown()


def assert_same(ours: list[dict], ref: list[dict]) -> None:
    assert [r["output_ids"] for r in ours] == [r["output_ids"] for r in ref]
    for a, b in zip(ours, ref, strict=True):
        for x, y in zip(a["meta_info"]["input_token_logprobs"] or [], b["meta_info"]["input_token_logprobs"] or []):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4


def test_tp2_matches_tp1(tiny_model_dir: Path, reference: list[dict]) -> None:
    engine = make_engine(tiny_model_dir, 2)
    try:
        assert_same(run_workload(engine), reference)
        assert sum(r["meta_info"]["cached_tokens"] for r in reference) > 0
        assert engine.server_info()["cache_stats"]["forward_steps"] > 0
    finally:
        engine.shutdown()


def _chat(url: str) -> list[str | None]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    out = []
    for prompt in PROMPTS[:3]:
        res = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0
        )
        out.append(res.choices[0].message.content)
    return out


def test_tp2_through_the_server(tiny_model_dir: Path) -> None:
    answers = []
    for tp in (1, 2):
        engine = make_engine(tiny_model_dir, tp)
        try:
            with ServerThread(create_app(engine, ServerConfig(), model="tiny")) as srv:
                answers.append(_chat(srv.url))
        finally:
            engine.shutdown()
    assert answers[0] == answers[1] and all(answers[0])


def test_two_nodes_on_loopback(tiny_model_dir: Path, reference: list[dict]) -> None:
    """Node 1 is `radixserve serve --node-rank 1` (ranks only, no server); node 0 serves. Stopping the engine
    stops node 1's ranks and its process exits 0."""
    addr = f"127.0.0.1:{free_port()}"
    flags = ["--tp", "2", "--nnodes", "2", "--dist-init-addr", addr, "--device", "cpu", "--max-total-tokens", "4096"]
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "radixserve.server.cli",
            "serve",
            "--model",
            str(tiny_model_dir),
            "--node-rank",
            "1",
            *flags,
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        engine = make_engine(tiny_model_dir, 2, nnodes=2, node_rank=0, dist_init_addr=addr)
        try:
            assert_same(run_workload(engine), reference)
        finally:
            engine.shutdown()
        assert node1.wait(timeout=60) == 0, node1.stderr.read() if node1.stderr else ""
    finally:
        if node1.poll() is None:
            node1.kill()


def test_dead_worker_stops_the_engine(tiny_model_dir: Path) -> None:
    engine = make_engine(tiny_model_dir, 2)
    try:
        assert engine.generate(PROMPTS[0], greedy(4))["meta_info"]["finish_reason"] == "length"
        worker = engine._tp.procs[0]  # type: ignore[union-attr]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        failed = engine.generate(PROMPTS[1], greedy(4))
        assert failed["meta_info"]["finish_reason"] == "error"
        assert "worker" in failed["meta_info"]["error"] and "exited" in failed["meta_info"]["error"]
        assert not engine.alive and "worker" in (engine.error or "")
    finally:
        engine.shutdown()


def test_sharding_the_meta_model_cuts_shapes_without_the_compiler_stack(tiny_model_dir: Path) -> None:
    """A rank shards its model on the meta device before loading: the shapes are cut, and no meta-tensor op pulls
    in torch._dynamo (and Triton with it), which cost every rank ~125 MiB resident (a fresh process: other tests
    may have imported it here)."""
    code = f"""
import sys
from pathlib import Path
import torch
from radixserve.runtime.distributed.shard import shard_model
from radixserve.runtime.loader import build_model
from radixserve.runtime.models.llama import ModelArgs
from radixserve.runtime.weights import load_hf_config
args = ModelArgs.from_hf_config(load_hf_config(Path({str(tiny_model_dir)!r})))
model = build_model(args, torch.bfloat16, torch.device("cpu"))
whole = model.model.layers[0].self_attn.qkv_proj.weight.shape
shard_model(model, 1, 2, None)
attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
print("torch._dynamo" in sys.modules, whole[0] // 2 == attn.qkv_proj.weight.shape[0],
      attn.o_proj.weight.shape[1] * 2 == args.hidden_size, mlp.down_proj.weight.is_meta)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True", "True", "True"]


def test_tp_that_does_not_divide_the_heads_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="--tp 3 does not divide the model's 4 attention heads"):
        make_engine(tiny_model_dir, 3)
    # Nothing was left behind: a correct engine starts in the same process right after.
    engine = make_engine(tiny_model_dir, 2)
    engine.shutdown()


def _serve_and_chat(model: str, tp: int) -> list[str | None]:
    # Under tensor parallelism a GGUF's blocks are dequantized at load: the one-rank run must compute the same.
    engine = make_engine(model, tp, quantization="none")
    try:
        with ServerThread(create_app(engine, ServerConfig(), model="tiny")) as srv:
            return _chat(srv.url)
    finally:
        engine.shutdown()


@pytest.mark.real_model
def test_real_model_tp3_through_the_server() -> None:
    """SmolLM2-135M has 9 attention heads, 3 key/value heads and an MLP width of 1536: --tp 3 divides them."""
    assert _serve_and_chat("smollm2-135m-instruct", 3) == _serve_and_chat("smollm2-135m-instruct", 1)
