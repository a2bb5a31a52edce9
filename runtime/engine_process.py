"""The engine in a process of its own, behind the API of the in-process ``Engine``.

Why: in one process the HTTP front end (parsing, chat templates, tokenization, JSON and SSE encoding) and the
engine loop share one interpreter lock, and every moment the front end holds it delays the next step. Here the
front end and the engine are two processes that exchange the typed messages of ``runtime.ipc`` over a pipe, as
vLLM's EngineCore and SGLang's scheduler process do.

Ownership. The engine process owns an ordinary ``Engine``, and through it every piece of serving state; it
detokenizes too (stop strings must cut the output, and free the KV, in the step that matched them). The front end
owns the output sinks and its own view of the queue: ``submit`` refuses a request at once, like ``Engine.submit``,
from the engine's last reported queue depth plus the requests sent since (so it can refuse a moment early, never
let the queue past ``--max-queued-requests``).

Threads. Front end: callers, and one reader that hands ``Outputs`` to the sinks and ``Reply`` to futures. Engine
process (``runtime.engine_worker``): its main thread reads messages, the engine thread steps, one writer sends
each burst of outputs as one message. If the engine process dies, every request in flight gets a final output
with the error, and ``alive`` turns false (``/health`` reports it); if the front end dies, the engine process
sees the pipe close and exits.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import subprocess
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from radixserve.runtime import ipc
from radixserve.runtime.config import EngineConfig
from radixserve.runtime.engine_api import EngineAPI, Sink, final_output
from radixserve.runtime.engine_spawn import Spawned, spawn_engine_process
from radixserve.runtime.errors import EngineDeadError, EngineOverloadedError
from radixserve.runtime.lora_spec import lora_names
from radixserve.runtime.model_source import model_folder, tokenizer_folder
from radixserve.runtime.request import ErrorCode, FinishReason, Req, ReqOutput
from radixserve.runtime.sampling_params import SamplingParams
from radixserve.runtime.validation import validate_request
from radixserve.runtime.weights import load_tokenizer

if TYPE_CHECKING:
    from radixserve.runtime.pooling import PoolingModel

logger = logging.getLogger("radixserve.engine")

STOP_TIMEOUT_S = 15.0
LORA_TIMEOUT_S = 120.0  # reading an adapter of a large model


class EngineProcess(EngineAPI):
    """``EngineProcess(model=..., ...)`` starts the engine process and returns once the model is loaded.

    Thread-safe like ``Engine``. Beyond ``Engine``'s API it lacks ``call(fn)`` (a function cannot cross the process
    boundary); ``server_info``, ``flush_cache`` and ``check_kv`` are there instead.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        wait: bool = True,
        spawned: Spawned | None = None,
        **overrides: Any,
    ) -> None:
        """Start the engine process (or take over one ``spawn_engine_process`` started). With ``wait=False`` this
        returns at once, the model loading in the background (``radixserve serve`` starts its HTTP server
        meanwhile); call ``wait_ready`` before anything else."""
        if spawned is None:
            config = replace(config, **overrides) if config is not None else EngineConfig(**overrides)
            spawned = spawn_engine_process(config)
        elif config is not None or overrides:
            raise ValueError("pass either a spawned engine process or its config, not both")
        self.config = spawned.config
        # The adapters served: the front end's view, changed only by its own load_lora / unload_lora.
        self._lora_names = lora_names(self.config.lora_modules)
        self._proc = spawned.proc
        self._conn = spawned.conn
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._sinks: dict[str, Sink] = {}
        self._calls: dict[int, Future[Any]] = {}
        self._call_ids = itertools.count()
        self._ids = itertools.count()
        self._sent_adds = 0
        self._adds_taken = 0
        self._engine_queued = 0
        self._stopping = False
        self._dead = False
        self._ready = False
        self.error: str | None = None
        self.pooling: PoolingModel | None = None  # (known once ready)
        if wait:
            self.wait_ready()

    def wait_ready(self) -> EngineProcess:
        """Load the tokenizer here while the engine process loads the model, then wait for it; returns ``self``.
        Raises ``ValueError`` (a configuration mistake) or ``RuntimeError`` if the engine could not be built."""
        if self._ready:
            return self
        try:
            # Both processes resolve the model: whichever comes first fetches or converts it under the cache's
            # lock, the other then finds it cached.
            folder = model_folder(self.config)
            self.model_folder = folder
            self.tokenizer = load_tokenizer(tokenizer_folder(self.config, folder))
            info = self._await_ready()
        except BaseException:
            self.shutdown(timeout=5)
            raise
        self.model_name = info.model_name
        self.vocab_size = info.vocab_size
        self.max_context_len = info.max_context_len
        self.kv_total_tokens = info.kv_total_tokens
        self.dtype = info.dtype
        self.device = info.device
        self.pid = info.pid
        self.pooling = info.pooling
        self._reader = threading.Thread(target=self._read_loop, name="radixserve-engine-in", daemon=True)
        self._reader.start()
        self._ready = True
        return self

    def _await_ready(self) -> ipc.EngineInfo:
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            code = _wait(self._proc, 5)
            raise RuntimeError(f"the engine process exited while loading (status {code})") from None
        if isinstance(msg, ipc.LoadFailed):
            _wait(self._proc, STOP_TIMEOUT_S)
            raise (ValueError if msg.config_error else RuntimeError)(msg.error)
        assert isinstance(msg, ipc.Ready), msg
        return msg.info

    # --- the API of Engine ----------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return (
            self._ready and not self._dead and not self._stopping and self.error is None and self._proc.poll() is None
        )

    @property
    def num_queued(self) -> int:
        with self._lock:
            return self._engine_queued + self._sent_adds - self._adds_taken

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._sinks)

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, sink: Sink, rid: str | None = None) -> str:
        """As ``Engine.submit``: raises ``ValueError``, ``EngineOverloadedError`` or ``EngineDeadError`` at once."""
        if not self.alive:
            raise EngineDeadError(self.error or "the engine has shut down")
        prompt = [int(t) for t in prompt_ids]
        validate_request(
            prompt,
            params,
            self.vocab_size,
            self.max_context_len,
            self.kv_total_tokens,
            self.config.schedule_policy,
            self._lora_names,
            self.pooling,
        )
        rid = rid or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        with self._lock:
            if rid in self._sinks:
                # As the in-process engine does: the newcomer fails alone, the running request keeps its sink.
                req = Req(rid, prompt, params)
                req.fail(f"request id {rid!r} is already in use", ErrorCode.INVALID)
                sink(final_output(req))
                return rid
            queued = self._engine_queued + self._sent_adds - self._adds_taken
            if queued >= self.config.max_queued_requests:
                raise EngineOverloadedError(
                    f"the waiting queue is full ({queued} requests wait for admission, --max-queued-requests "
                    f"{self.config.max_queued_requests}); retry later"
                )
            self._sinks[rid] = sink
            self._sent_adds += 1
            try:
                self._send(ipc.Add(rid, prompt, params))
            except OSError as exc:
                self._sinks.pop(rid, None)
                self._sent_adds -= 1
                raise EngineDeadError(f"the engine process is gone: {exc}") from None
        return rid

    def abort(self, rid: str) -> None:
        with self._lock:
            if rid not in self._sinks:
                return  # finished already: nothing to abort
        with contextlib.suppress(OSError):  # the engine is gone: the reader fails the request
            self._send(ipc.Abort(rid))

    def compile(self, spec: Any) -> Future[Any]:
        """Compile a constraint into the engine's cache; the future fails with the ``GrammarError`` (or the
        ``TokenizerError``) of the compile, and resolves to ``None`` otherwise."""
        return self._request(lambda cid: ipc.Compile(cid, spec))

    def server_info(self) -> dict[str, Any]:
        return self._request(lambda cid: ipc.Call(cid, "server_info")).result(30)

    def flush_cache(self) -> bool:
        return bool(self._request(lambda cid: ipc.Call(cid, "flush_cache")).result(30))

    def check_kv(self) -> dict[str, int]:
        """Run the KV accounting check in the engine (raises ``RuntimeError`` on a leak); returns the KV usage."""
        return self._request(lambda cid: ipc.Call(cid, "check_kv")).result(30)

    @property
    def lora_names(self) -> tuple[str, ...]:
        return self._lora_names

    def load_lora(self, name: str, path: str) -> tuple[str, ...]:
        # The engine's answer is the list served then: the front end takes it whole (no drift between the two).
        self._lora_names = self._request(lambda cid: ipc.Call(cid, "load_lora", (name, path))).result(LORA_TIMEOUT_S)
        return self._lora_names

    def unload_lora(self, name: str) -> tuple[str, ...]:
        self._lora_names = self._request(lambda cid: ipc.Call(cid, "unload_lora", (name,))).result(LORA_TIMEOUT_S)
        return self._lora_names

    def shutdown(self, timeout: float = STOP_TIMEOUT_S) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            self._send(ipc.Stop())
        if _wait(self._proc, timeout) is None:
            logger.warning("the engine process did not stop within %.0f s; killing it", timeout)
            self._proc.kill()  # (it ignores SIGTERM: see _engine_main)
            _wait(self._proc, 5)
        if self._ready:
            self._reader.join(5)

    # --- internals ------------------------------------------------------------------------------------------
    def _send(self, msg: Any) -> None:
        with self._send_lock:
            self._conn.send(msg)

    def _request(self, make: Callable[[int], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        if not self.alive:
            fut.set_exception(EngineDeadError(self.error or "the engine has shut down"))
            return fut
        call_id = next(self._call_ids)
        with self._lock:
            self._calls[call_id] = fut
        try:
            self._send(make(call_id))
        except OSError as exc:
            with self._lock:
                self._calls.pop(call_id, None)
            fut.set_exception(EngineDeadError(f"the engine process is gone: {exc}"))
        return fut

    def _read_loop(self) -> None:
        try:
            while True:
                msg = self._conn.recv()
                if isinstance(msg, ipc.Outputs):
                    self._deliver(msg)
                elif isinstance(msg, ipc.Reply):
                    with self._lock:
                        fut = self._calls.pop(msg.call_id, None)
                    if fut is not None:
                        if msg.error is not None:
                            fut.set_exception(msg.error)
                        else:
                            fut.set_result(msg.value)
                elif isinstance(msg, ipc.Died):
                    logger.error("the engine stopped: %s", msg.error)
                    self.error = msg.error
        except (EOFError, OSError):
            pass
        code = _wait(self._proc, 5)
        if not self._stopping and self.error is None:
            self.error = f"the engine process exited unexpectedly (status {code})"
            logger.error("%s", self.error)
        self._dead = True
        self._fail_all()

    def _deliver(self, msg: ipc.Outputs) -> None:
        with self._lock:
            self._engine_queued = msg.queued
            self._adds_taken = msg.adds_taken
            sinks = []
            for out in msg.outputs:
                sinks.append(self._sinks.pop(out.rid, None) if out.finished else self._sinks.get(out.rid))
        for sink, out in zip(sinks, msg.outputs):
            if sink is not None:
                try:
                    sink(out)
                except Exception:  # noqa: BLE001 - a broken consumer must not stop the reader
                    logger.exception("output sink of %s failed", out.rid)

    def _fail_all(self) -> None:
        """The engine process is gone: every request and call still waiting gets its answer."""
        with self._lock:
            sinks, self._sinks = self._sinks, {}
            calls, self._calls = self._calls, {}
        reason = FinishReason.ABORT if self._stopping and self.error is None else FinishReason.ERROR
        for rid, sink in sinks.items():
            out = ReqOutput(rid=rid, text="", token_ids=[], logprobs=[], finished=True, finish_reason=reason)
            if reason is FinishReason.ERROR:
                out.error, out.error_code = self.error, ErrorCode.ENGINE.value
            try:
                sink(out)
            except Exception:  # noqa: BLE001
                logger.exception("output sink of %s failed", rid)
        for fut in calls.values():
            fut.set_exception(EngineDeadError(self.error or "the engine has shut down"))


def _wait(proc: subprocess.Popen, timeout: float) -> int | None:
    """The process's exit status once it exits within ``timeout`` seconds, else ``None``."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None
