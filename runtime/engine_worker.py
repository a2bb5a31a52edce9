"""The engine process's side of ``runtime.engine_process``: it builds an ``Engine``, answers the front end's
typed messages (``runtime.ipc``) and sends each burst of outputs back as one message.

Threads: the main thread reads messages, the engine thread steps, one writer sends. Started by
``runtime.engine_spawn`` as ``python -m radixserve.runtime.engine_worker FD``; its first message is ``ipc.Start``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from radixserve.runtime import ipc
from radixserve.runtime.config import EngineConfig
from radixserve.runtime.engine_api import final_output
from radixserve.runtime.errors import EngineOverloadedError
from radixserve.runtime.logs import configure_logging
from radixserve.runtime.request import ErrorCode, Req, ReqOutput

logger = logging.getLogger("radixserve.engine")

# The writer also wakes this often when idle, to notice an engine loop that died.
WRITER_POLL_S = 0.5


def engine_main(config: EngineConfig, conn: Connection, log_level: str, log_format: str) -> None:
    from radixserve.runtime.engine import Engine

    # The front end decides when the engine stops (it drains first, then sends Stop; past its timeout it kills):
    # Ctrl+C reaches the whole process group, and so does SIGTERM from supervisors that signal the group
    # (systemd's control-group kill, dumb-init, `timeout`), which would otherwise cut the drain short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(log_level, log_format)
    try:
        engine = Engine(config, lean_tokenizer=True)  # decoding only here: no transformers import
    except BaseException as exc:  # noqa: BLE001 - reported to the front end, which raises it
        if not isinstance(exc, ValueError):
            logger.exception("loading the model failed")
        conn.send(
            ipc.LoadFailed(
                f"{type(exc).__name__}: {exc}" if not isinstance(exc, ValueError) else str(exc),
                isinstance(exc, ValueError),
            )
        )
        return
    bridge = _Bridge(engine, conn)
    info = engine.server_info()
    bridge.send(
        ipc.Ready(
            ipc.EngineInfo(
                model_name=engine.model_name,
                vocab_size=engine.vocab_size,
                max_context_len=engine.max_context_len,
                kv_total_tokens=int(info["kv_cache"]["total_tokens"]),
                dtype=info["dtype"],
                device=info["device"],
                pid=os.getpid(),
                pooling=engine.pooling,
            )
        )
    )
    try:
        bridge.serve()
    finally:
        engine.shutdown()
        bridge.close()


def _error_code(exc: Exception) -> ErrorCode:
    """Why ``Engine.submit`` refused a request, for the front end (which raised nothing: it had sent it)."""
    if isinstance(exc, EngineOverloadedError):
        return ErrorCode.OVERLOADED
    return ErrorCode.INVALID if isinstance(exc, ValueError) else ErrorCode.ENGINE


class _Bridge:
    """The engine process's end of the pipe: messages in on the main thread, output bursts out on a writer."""

    def __init__(self, engine: Any, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._pending: list[ReqOutput] = []
        self._dirty = False  # the queue changed (an Add was taken) with no output to carry the news
        self._closed = False
        self._adds_taken = 0
        self._writer = threading.Thread(target=self._write_loop, name="radixserve-engine-out", daemon=True)
        self._writer.start()

    def send(self, msg: Any) -> None:
        # OSError: the front end is gone; the main thread sees EOF and stops the engine.
        with self._send_lock, contextlib.suppress(OSError):
            self.conn.send(msg)

    def sink(self, out: ReqOutput) -> None:
        """Every request's sink (engine thread): queue the delta for the writer."""
        with self._cond:
            self._pending.append(out)
            self._cond.notify()

    def serve(self) -> None:
        engine = self.engine
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                logger.info("the front end closed the pipe; stopping the engine")
                return
            if isinstance(msg, ipc.Add):
                try:
                    engine.submit(msg.prompt_ids, msg.params, self.sink, rid=msg.rid)
                except Exception as exc:  # noqa: BLE001 - the request fails alone, through its outputs
                    req = Req(msg.rid, msg.prompt_ids, msg.params)
                    req.fail(str(exc), _error_code(exc))
                    self.sink(final_output(req))
                with self._cond:
                    self._adds_taken += 1
                    self._dirty = True
                    self._cond.notify()
            elif isinstance(msg, ipc.Abort):
                engine.abort(msg.rid)
            elif isinstance(msg, ipc.Compile):
                self._compile(msg)
            elif isinstance(msg, ipc.Call):
                # engine.call waits for the step in progress: off this thread, so Adds keep flowing meanwhile.
                threading.Thread(target=self._call, args=(msg,), daemon=True).start()
            elif isinstance(msg, ipc.Stop):
                return

    def _compile(self, msg: ipc.Compile) -> None:
        try:
            fut = self.engine.compile(msg.spec)
        except Exception as exc:  # noqa: BLE001 - a GrammarError or TokenizerError, for the front end
            self.send(ipc.Reply(msg.call_id, error=exc))
            return
        fut.add_done_callback(lambda f: self.send(ipc.Reply(msg.call_id, error=f.exception())))

    def _call(self, msg: ipc.Call) -> None:
        engine = self.engine
        try:
            if msg.name == "server_info":
                value: Any = engine.server_info()
            elif msg.name == "flush_cache":
                value = engine.flush_cache()
            elif msg.name == "check_kv":
                value = engine.check_kv()
            elif msg.name == "load_lora":
                value = engine.load_lora(*msg.args)
            elif msg.name == "unload_lora":
                value = engine.unload_lora(*msg.args)
            else:
                raise ValueError(f"unknown call {msg.name!r}")
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            self.send(ipc.Reply(msg.call_id, error=exc))
        else:
            self.send(ipc.Reply(msg.call_id, value=value))

    def _write_loop(self) -> None:
        died_sent = False
        while True:
            with self._cond:
                if not self._pending and not self._dirty and not self._closed:
                    self._cond.wait(WRITER_POLL_S)
                outs, self._pending = self._pending, []
                dirty, self._dirty = self._dirty, False
                closed = self._closed
                taken = self._adds_taken
            if outs or dirty:
                self.send(ipc.Outputs(outs, self.engine.num_queued, taken))
            if not died_sent and self.engine.error is not None:
                self.send(ipc.Died(self.engine.error))
                died_sent = True
            if closed and not outs:
                return

    def close(self) -> None:
        """After the engine shut down (its last outputs are queued): send what is left, then stop the writer."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._writer.join(10)


if __name__ == "__main__":
    _conn = Connection(int(sys.argv[1]))
    _start = _conn.recv()
    engine_main(_start.config, _conn, _start.log_level, _start.log_format)
