"""``RuntimeEndpoint``: a radixserve server over HTTP (``/generate``, ``/tokenize``, ``/server_info``).

Requests carry text; the server tokenizes it. Every HTTP error becomes a ``BackendError`` with the server's
status, message and parameter name; a server that cannot be reached is a ``BackendError`` with ``status=None``.
A request refused because the server's queue is full (429: a ``select`` sends one scoring request per choice, and
``run_batch`` many programs at once) is sent again after the wait the server asks for, within ``timeout``.
"""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import requests

from radixserve.lang.backend.base import Backend, GenOutput, overload_backoff_s
from radixserve.lang.errors import BackendError

DEFAULT_TIMEOUT_S = 600.0  # also how long a request refused for a full queue (429) is retried


def _retry_after(resp: requests.Response) -> float:
    """The response's Retry-After in seconds; 0 when it has none that is a number of seconds."""
    try:
        return max(0.0, float(resp.headers.get("Retry-After", "")))
    except ValueError:
        return 0.0


class RuntimeEndpoint(Backend):
    """``RuntimeEndpoint("http://127.0.0.1:30000", api_key=None)``. Connects lazily: nothing is sent until a
    program runs. Thread-safe (one HTTP session per thread)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__()
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self._local = threading.local()
        self._queue_bound: int | None = None  # 0: the server did not say

    def __repr__(self) -> str:
        return f"RuntimeEndpoint({self.base_url!r})"

    # --- HTTP -----------------------------------------------------------------------------------------------
    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            if self.api_key:
                session.headers["Authorization"] = f"Bearer {self.api_key}"
            self._local.session = session
        return session

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None, stream: bool = False) -> Any:
        """The response (``stream``) or its JSON; ``BackendError`` on any failure."""
        url = self.base_url + path
        try:  # encoded here, strictly: requests would report a nan or a set as "cannot reach the server"
            data = None if body is None else json.dumps(body, allow_nan=False).encode("utf-8")
        except (TypeError, ValueError) as exc:
            raise BackendError(f"the request to {path} cannot be sent as JSON: {exc}") from None
        headers = None if data is None else {"Content-Type": "application/json"}
        patience = time.monotonic() + self.timeout
        for attempt in itertools.count():
            try:
                resp = self._session().request(
                    method, url, data=data, headers=headers, stream=stream, timeout=self.timeout
                )
            except requests.RequestException as exc:
                raise BackendError(f"cannot reach the server at {self.base_url}: {exc}") from None
            if resp.status_code != 429 or time.monotonic() >= patience:
                break
            # The queue was full and nothing of the request was kept (a batch is all or nothing): wait as the
            # server asks (its Retry-After, with the same jitter), or by overload_backoff_s, and send it again.
            with resp:
                wait = _retry_after(resp) * (0.5 + random.random()) or overload_backoff_s(attempt)
            time.sleep(min(wait, max(0.0, patience - time.monotonic())))
        if resp.status_code >= 400:
            with resp:
                raise _http_error(resp)
        if stream:
            return resp
        try:
            return resp.json()
        except ValueError:
            raise BackendError(f"{path} answered with non-JSON: {resp.text[:200]!r}", resp.status_code) from None

    # --- Backend --------------------------------------------------------------------------------------------
    def generate(
        self,
        prompt: str,
        sampling: dict[str, Any],
        *,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        on_text: Callable[[str], None] | None = None,
    ) -> GenOutput:
        body = {
            "text": prompt,
            "sampling_params": sampling,
            "return_logprob": return_logprob,
            "top_logprobs_num": top_logprobs_num,
            "return_text_in_logprobs": True,
            "stream": on_text is not None,
        }
        if on_text is None:
            return _output(self._call("POST", "/generate", body))
        last: dict[str, Any] | None = None
        sent = ""
        with self._call("POST", "/generate", body, stream=True) as resp:
            for payload in _events(resp, self.base_url):
                text = payload.get("text", "")
                if not text.startswith(sent):
                    raise BackendError(f"the server's stream rewrote text already sent ({sent!r} -> {text!r})")
                if len(text) > len(sent):
                    piece, sent = text[len(sent) :], text
                    on_text(piece)
                last = payload
        if last is None:
            raise BackendError("the server's stream ended without any result")
        return _output(last)

    def prefill(self, prompt: str) -> dict[str, Any]:
        out = self._call("POST", "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 0}})
        return dict(out["meta_info"])

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        return [list(t) for t in self._call("POST", "/tokenize", {"prompt": list(texts)})["tokens"]]

    def prompt_logprobs(
        self, input_ids: list[list[int]], start: int, routing_text: str | None = None
    ) -> list[list[float]]:
        if start < 1:
            raise ValueError("prompt_logprobs: start must be >= 1 (nothing predicts the first token)")
        body = {
            "input_ids": [list(ids) for ids in input_ids],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": start,
        }
        if routing_text is not None:
            body["routing_text"] = routing_text
        results = self._call("POST", "/generate", body)
        return [[float(e[0]) for e in r["meta_info"]["input_token_logprobs"]] for r in results]

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        body = {"messages": messages, "add_generation_prompt": add_generation_prompt}
        return str(self._call("POST", "/tokenize", body)["prompt"])

    def server_info(self) -> dict[str, Any]:
        return dict(self._call("GET", "/server_info"))

    def queue_bound(self) -> int | None:
        """From ``/server_info`` once (through a router: one replica's, and every replica runs the same config)."""
        if self._queue_bound is None:
            try:
                bound = self.server_info().get("config", {}).get("max_queued_requests")
            except BackendError:
                return None
            self._queue_bound = int(bound) if isinstance(bound, int) and bound > 0 else 0
        return self._queue_bound or None

    def flush_cache(self) -> None:
        self._call("POST", "/flush_cache")


def _http_error(resp: requests.Response) -> BackendError:
    try:
        err = resp.json()["error"]
        return BackendError(str(err["message"]), resp.status_code, err.get("param"), err.get("code"))
    except (ValueError, KeyError, TypeError):
        return BackendError(resp.text[:500] or str(resp.reason), resp.status_code)


def _events(resp: requests.Response, base_url: str) -> Iterator[dict[str, Any]]:
    """The JSON payloads of an SSE stream (UTF-8 decoded here: requests would assume Latin-1 for text/*); a
    connection lost mid-stream or a garbled event is a ``BackendError`` like any other failure."""
    lines = resp.iter_lines()
    while True:
        try:
            raw = next(lines, None)
        except requests.RequestException as exc:
            raise BackendError(f"the stream from {base_url} broke off: {exc}") from None
        if raw is None:
            raise BackendError(f"the stream from {base_url} ended without [DONE]")
        line = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            return
        try:
            payload = json.loads(data)
        except ValueError:
            payload = None
        if not isinstance(payload, dict) or not isinstance(payload.get("error", {}), dict):
            raise BackendError(f"the stream from {base_url} sent an event that is not JSON: {data[:200]!r}")
        if "error" in payload:
            err = payload["error"]
            code = err.get("code")
            raise BackendError(str(err.get("message")), code if isinstance(code, int) else None, err.get("param"), code)
        yield payload


def _output(result: dict[str, Any]) -> GenOutput:
    return GenOutput(str(result["text"]), list(result.get("output_ids") or []), dict(result.get("meta_info") or {}))
