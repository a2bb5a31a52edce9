"""llama.cpp as a benchmark peer: a plain GGUF of our model, its server as a subprocess, and a streaming client.

An optional benchmark dependency. Two servers are supported, found in this order:

* ``llama-server`` (llama.cpp's C++ server: parallel slots, continuous batching, per-slot prompt cache) --
  given with ``--llamacpp-server PATH``, ``$LLAMA_SERVER`` or found on ``PATH``. It is the fair peer.
  ``pip install llama-cpp-python`` does not install it; build it from the llama.cpp sources that the
  llama-cpp-python sdist vendors (see docs/benchmarks.md).
* ``python -m llama_cpp.server`` (``pip install 'llama-cpp-python[server]'``): the same kernels, but one
  request at a time (no parallel slots), so its numbers are a lower bound for llama.cpp.

The model is served from an F32 (or BF16) GGUF made by dequantizing the GGUF our model was converted from (the
built-in model ships as Q4_1; our engine at ``--quantization none`` runs the dequantization of the same weights),
so both systems compute with identical weights. Only loopback (127.0.0.1) is used.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from radixserve.runtime import envs
from radixserve.runtime.model_source import BUILTIN_MODELS, gguf_cache_key

HOST = "127.0.0.1"
SERVER_START_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 600.0


# --- the model as an F32 GGUF -------------------------------------------------------------------------
def source_gguf(model: str) -> Path | None:
    """The GGUF that ``model`` was converted from, or None when it was an HF folder (no GGUF to start from).

    For a built-in name the GGUF is extracted from the wheel in radixserve's download cache (the engine
    fetched it on first use) into a temporary file that the caller deletes.
    """
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path.resolve()
    builtin = BUILTIN_MODELS.get(model.strip().lower())
    if builtin is None:
        return None
    wheels = sorted((envs.cache_dir() / "downloads").glob(builtin.wheel_glob))
    if not wheels:
        return None
    fd, tmp = tempfile.mkstemp(suffix=".gguf", prefix="radixserve-src-")
    with os.fdopen(fd, "wb") as dst, zipfile.ZipFile(wheels[-1]) as zf, zf.open(builtin.wheel_member) as src:
        shutil.copyfileobj(src, dst, length=8 << 20)
    return Path(tmp)


# The plain types a GGUF's weights can be written in for the peer: F32 (what radixserve computes in at --dtype
# float32) or BF16 (the weights bfloat16 engines serve; as llama.cpp's own `convert_hf_to_gguf --outtype bf16`
# does, 1-D tensors, the norms, stay F32).
PLAIN_TYPES = ("f32", "bf16")


def dequantize_gguf(src: Path, dest: Path, kind: str = "f32") -> None:
    """Write ``dest``: ``src`` with every tensor dequantized to ``kind`` (``PLAIN_TYPES``; BF16 for matrices
    only) and its metadata copied unchanged."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, Keys, LlamaFileType
    from gguf.quants import dequantize, quantize

    if kind not in PLAIN_TYPES:
        raise ValueError(f"GGUF type {kind!r}: expected one of {', '.join(PLAIN_TYPES)}")
    reader = GGUFReader(str(src))
    arch = reader.fields[Keys.General.ARCHITECTURE].contents()
    writer = GGUFWriter(str(dest), arch=arch)
    for f in reader.fields.values():
        if f.name == Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        if f.name == Keys.General.FILE_TYPE:
            writer.add_file_type(LlamaFileType.ALL_F32 if kind == "f32" else LlamaFileType.MOSTLY_BF16)
            continue
        vtype = f.types[0]
        sub_type = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), vtype, sub_type=sub_type)
    for t in reader.tensors:
        data = t.data if t.tensor_type == GGMLQuantizationType.F32 else dequantize(t.data, t.tensor_type)
        data = np.ascontiguousarray(data, dtype=np.float32)
        if kind == "bf16" and data.ndim >= 2:
            writer.add_tensor(t.name, quantize(data, GGMLQuantizationType.BF16), raw_dtype=GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def plain_gguf(model: str, kind: str = "f32") -> Path | None:
    """A GGUF of ``model`` with its weights in ``kind`` (``PLAIN_TYPES``), made once and cached next to
    radixserve's converted models; None if impossible."""
    src = source_gguf(model)
    if src is None:
        return None
    is_temp = src.name.startswith("radixserve-src-")
    try:
        name = BUILTIN_MODELS[model.strip().lower()].name if is_temp else gguf_cache_key(src)
        target = envs.cache_dir() / "gguf" / f"{name}-{kind}.gguf"
        if target.is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".gguf", prefix=f".tmp-{name}~", dir=target.parent)
        os.close(fd)
        try:
            print(f"converting {src.name} to a {kind.upper()} GGUF (once) ...", file=sys.stderr, flush=True)
            dequantize_gguf(src, Path(tmp), kind)
            os.replace(tmp, target)
        finally:
            Path(tmp).unlink(missing_ok=True)
        return target
    finally:
        if is_temp:
            src.unlink(missing_ok=True)


# --- the server ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerKind:
    """How to start one of the two servers: ``native`` is llama.cpp's C++ ``llama-server``."""

    name: str  # "llama-server" or "llama-cpp-python"
    command: tuple[str, ...]

    @property
    def native(self) -> bool:
        return self.name == "llama-server"


def find_server(explicit: str | None) -> tuple[ServerKind | None, str]:
    """The server to use and a note saying which (or why none)."""
    for candidate in (explicit, os.environ.get("LLAMA_SERVER"), shutil.which("llama-server")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return ServerKind("llama-server", (str(Path(candidate).resolve()),)), "llama.cpp llama-server"
    if explicit:
        return None, f"--llamacpp-server {explicit} is not an executable file"
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError:
        return None, (
            "llama.cpp skipped: neither llama-server (--llamacpp-server, $LLAMA_SERVER, PATH) nor "
            "llama-cpp-python[server] is installed"
        )
    return (
        ServerKind("llama-cpp-python", (sys.executable, "-m", "llama_cpp.server")),
        "llama-cpp-python's server (no parallel slots: requests run one at a time)",
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def server_argv(kind: ServerKind, gguf: Path, port: int, threads: int, parallel: int, ctx_per_slot: int) -> list[str]:
    if kind.native:
        return [
            *kind.command, "--model", str(gguf), "--host", HOST, "--port", str(port),
            "--threads", str(threads), "--threads-batch", str(threads), "--parallel", str(parallel),
            "--ctx-size", str(parallel * ctx_per_slot), "--no-webui",
        ]  # fmt: skip
    return [
        *kind.command, "--model", str(gguf), "--host", HOST, "--port", str(port),
        "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", str(ctx_per_slot),
        "--cache", "true", "--logits_all", "false", "--interrupt_requests", "false",
    ]  # fmt: skip


class LlamaServer:
    """A llama.cpp server subprocess on 127.0.0.1; ``with LlamaServer(...) as srv:`` waits until it answers."""

    def __init__(
        self,
        kind: ServerKind,
        gguf: Path,
        threads: int,
        parallel: int,
        ctx_per_slot: int,
        omp_wait_policy: str | None = None,
    ) -> None:
        self.kind = kind
        self.port = free_port()
        self.argv = server_argv(kind, gguf, self.port, threads, parallel, ctx_per_slot)
        # ggml's OpenMP threads spin while they wait by default; on a shared, oversubscribed CPU that wastes the
        # cores the other thread needs (several times slower), and PASSIVE makes them sleep instead.
        self.env = dict(os.environ)
        if omp_wait_policy:
            self.env["OMP_WAIT_POLICY"] = omp_wait_policy.upper()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in __exit__

    def __enter__(self) -> LlamaServer:
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        health = "/health" if self.kind.native else "/v1/models"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind.name} exited with {self.proc.returncode}:\n{self._log_tail()}")
            try:
                status, _ = _get(self.port, health)
                if status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.25)
        self.__exit__(None, None, None)
        raise RuntimeError(f"{self.kind.name} did not answer within {SERVER_START_TIMEOUT_S:.0f} s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def _log_tail(self, n: int = 20) -> str:
        self.log.seek(0)
        return "\n".join(self.log.read().decode(errors="replace").splitlines()[-n:])


def _get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


# --- the client ---------------------------------------------------------------------------------------
@dataclass
class Completion:
    """One streamed completion: when it was sent and its first token arrived (perf_counter), and its output."""

    sent_at: float
    first_at: float = 0.0
    done_at: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    prompt_computed: int | None = None  # prompt tokens the server computed
    prompt_cached: int | None = None  # prompt tokens it reused from its cache


def request_body(
    kind: ServerKind, api: str, prompt_ids: Sequence[int], max_tokens: int, eos_id: int, tokenizer: Any
) -> dict[str, Any]:
    """Greedy, exactly ``max_tokens`` tokens, streamed, prompt cache on."""
    body: dict[str, Any] = {"prompt": list(prompt_ids), "temperature": 0.0, "top_k": 1, "stream": True}
    if kind.native and api == "native":
        body.update(n_predict=max_tokens, ignore_eos=True, cache_prompt=True, return_tokens=True)
    elif kind.native:
        body.update(max_tokens=max_tokens, ignore_eos=True, cache_prompt=True)
    else:
        # llama-cpp-python takes text prompts only (its tokenizer parses the special tokens back), and has no
        # ignore_eos: forbidding EOS is the same for greedy decoding.
        body.update(
            prompt=tokenizer.decode(list(prompt_ids), skip_special_tokens=False),
            max_tokens=max_tokens,
            logit_bias={str(eos_id): -100.0},
        )
    return body


def complete(
    port: int, kind: ServerKind, api: str, prompt_ids: Sequence[int], max_tokens: int, eos_id: int, tokenizer: Any
) -> Completion:
    """Send one streamed completion and read it to the end.

    The native ``/completion`` route streams each token's id; the OpenAI ``/v1/completions`` route streams
    only text, which is tokenized again (what an OpenAI client would have to do).
    """
    path = "/completion" if kind.native and api == "native" else "/v1/completions"
    body = json.dumps(request_body(kind, api, prompt_ids, max_tokens, eos_id, tokenizer))
    conn = http.client.HTTPConnection(HOST, port, timeout=REQUEST_TIMEOUT_S)
    out = Completion(sent_at=time.perf_counter())
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{path} answered {resp.status}: {resp.read()[:500]!r}")
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            _absorb(out, json.loads(payload))
    finally:
        conn.close()
    out.done_at = time.perf_counter()
    if not out.token_ids and out.text:
        out.token_ids = tokenizer.encode(out.text, add_special_tokens=False)
    return out


def _absorb(out: Completion, chunk: dict[str, Any]) -> None:
    if "choices" in chunk:  # OpenAI shape
        piece = "".join(c.get("text") or "" for c in chunk["choices"])
        got = bool(piece)
        out.text += piece
    else:  # llama.cpp native shape
        tokens = chunk.get("tokens") or []
        got = bool(tokens) and not chunk.get("stop", False)
        if got:
            out.token_ids.extend(int(t) for t in tokens)
        out.text += chunk.get("content") or ""
    if got and not out.first_at:
        out.first_at = time.perf_counter()
    timings = chunk.get("timings")
    if timings and "prompt_n" in timings:
        out.prompt_computed = int(timings["prompt_n"])
        out.prompt_cached = int(timings.get("cache_n", 0))
    usage = chunk.get("usage")
    if usage and out.prompt_cached is None:
        details = usage.get("prompt_tokens_details") or {}
        if "cached_tokens" in details:
            out.prompt_cached = int(details["cached_tokens"])
            out.prompt_computed = int(usage["prompt_tokens"]) - out.prompt_cached
