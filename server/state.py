"""What every route shares: the engine (possibly still loading), the server config, metrics, requests in flight.

Life cycle of the engine as /health sees it: ``loading`` (503) -> ``ready`` (200) -> ``draining`` (503, the
server is shutting down: see ``server.lifecycle``) or ``dead`` (503) if its thread stops or loading failed. Routes
that need the engine call ``ready_engine()``, which raises the 503 (with Retry-After while loading or draining).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from radixserve.server.chat import render_chat
from radixserve.server.config import ServerConfig, check_adapter_names, default_served_name, load_chat_template
from radixserve.server.errors import APIError
from radixserve.server.generation_defaults import sampling_defaults
from radixserve.server.metrics import Metrics
from radixserve.server.reasoning import REASONING_PARSERS
from radixserve.server.responses_background import BackgroundRuns
from radixserve.server.responses_store import ResponseStore
from radixserve.server.tokens import TokenNames

RETRY_AFTER_UNAVAILABLE_S = 5

if TYPE_CHECKING:
    from radixserve.runtime.engine import Engine
    from radixserve.server.engine_client import RequestGroup
    from radixserve.server.protocol import ChatCompletionRequest

logger = logging.getLogger("radixserve.server")

EngineFactory = Callable[[], "Engine"]


class ServerState:
    def __init__(self, engine_or_factory: Engine | EngineFactory, config: ServerConfig, model_spec: str) -> None:
        self.config = config
        self.model_spec = model_spec
        # Every name a request may use; the first is the one responses and /v1/models report first.
        self.served_names = config.served_model_name or (default_served_name(model_spec),)
        self.served_name = self.served_names[0]
        self.sampling_defaults: dict[str, float | int] = {}
        self.chat_template = load_chat_template(config.chat_template) if config.chat_template else None
        self.reasoning_format = REASONING_PARSERS[config.reasoning_parser] if config.reasoning_parser else None
        self.responses = ResponseStore(config.responses_store_size)
        self.background = BackgroundRuns()  # background responses still running (only the event loop's)
        self.foreground: set[str] = set()  # the ids of responses running for their caller (not background)
        self.metrics = Metrics(self.served_name)
        self.inflight: dict[str, RequestGroup] = {}
        self.created = int(time.time())
        self.load_error: str | None = None
        self.kv_total_tokens = 0
        self.token_names: TokenNames | None = None
        self._engine: Engine | None = None
        self._factory: EngineFactory | None = None
        self.owns_engine = False
        self.stopping = False
        # Set when the server starts shutting down (SIGTERM): new requests get 503, in-flight ones finish.
        self.draining = False
        self.drain_deadline: float | None = None  # the event loop's time when the shutdown grace period ends
        self.ready_event = threading.Event()
        # Set by ``server.app.attach_server``: the URL uvicorn listens on (None until it does), and whether
        # uvicorn was asked to exit.
        self.listen_url: Callable[[], str | None] | None = None
        self.exit_requested: Callable[[], bool] | None = None
        if callable(engine_or_factory) and not hasattr(engine_or_factory, "submit"):
            self._factory = engine_or_factory
            self.owns_engine = True
        else:
            self._set_engine(engine_or_factory)  # type: ignore[arg-type]

    # --- loading ------------------------------------------------------------------------------------------
    def start_loading(self) -> None:
        """Build the engine on a background thread, so the server answers /health (503) while it loads."""
        if self._factory is None:
            return
        factory, self._factory = self._factory, None
        threading.Thread(target=self._load, args=(factory,), name="radixserve-load", daemon=True).start()

    def _load(self, factory: EngineFactory) -> None:
        engine = None
        try:
            engine = factory()
            if self.stopping:  # the server shut down while we loaded
                engine.shutdown()
                return
            self._set_engine(engine)  # (reads the generation config: a mistake there fails the start too)
        except BaseException as exc:  # noqa: BLE001 - reported on /health and by the CLI
            if isinstance(exc, ValueError):  # a configuration mistake: its message says what to change
                logger.error("loading the model failed: %s", exc)
            else:
                logger.exception("loading the model failed")
            self.load_error = f"loading the model failed: {type(exc).__name__}: {exc}"
            if engine is not None and self._engine is None:
                engine.shutdown()
            self.ready_event.set()

    def _set_engine(self, engine: Engine) -> None:
        self.check_adapter_names(engine.lora_names)
        self.sampling_defaults = sampling_defaults(self.config.generation_config, getattr(engine, "model_folder", None))
        self.kv_total_tokens = int(engine.server_info()["kv_cache"]["total_tokens"])
        self.token_names = TokenNames(engine.tokenizer)
        self._engine = engine
        self.ready_event.set()

    # --- status -------------------------------------------------------------------------------------------
    @property
    def engine(self) -> Engine | None:
        return self._engine

    def status(self) -> tuple[str, str | None]:
        """``(status, why)`` with status ``loading``, ``ready``, ``draining`` or ``dead``."""
        if self.load_error:
            return "dead", self.load_error
        engine = self._engine
        if engine is None:
            return "loading", "the model is still loading; retry when /health returns 200"
        if not engine.alive:
            return "dead", f"the engine is not running: {engine.error or 'it has shut down'}"
        if self.draining:
            return "draining", "the server is shutting down and takes no new requests; retry on another replica"
        return "ready", None

    def ready_engine(self) -> Engine:
        status, why = self.status()
        if status != "ready":
            headers = {"Retry-After": str(RETRY_AFTER_UNAVAILABLE_S)} if status in ("loading", "draining") else None
            raise APIError(503, why or status, code=f"engine_{status}", headers=headers)
        assert self._engine is not None
        return self._engine

    @property
    def lora_names(self) -> tuple[str, ...]:
        """The LoRA adapters served (``--lora-modules``, and those loaded since): each is a model name of its own."""
        return self._engine.lora_names if self._engine is not None else ()

    def check_adapter_names(self, names: Sequence[str]) -> None:
        check_adapter_names(names, self.served_names, self.model_spec)

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter ``model`` names (None: the base model); 404 unless ``model`` is the served name, the
        --model spec, an adapter's name (or left out)."""
        if model is None or model in self.served_names or model == self.model_spec:
            return None
        if model in self.lora_names:
            return model
        adapters = f" and the LoRA adapters {', '.join(map(repr, self.lora_names))}" if self.lora_names else ""
        raise APIError(
            404,
            f"the model {model!r} does not exist on this server; it serves {self.served_name!r}{adapters}",
            param="model",
            code="model_not_found",
        )

    def render_chat(self, req: ChatCompletionRequest) -> tuple[str, bool]:
        return render_chat(self.ready_engine().tokenizer, req, self.chat_template)

    def shutdown(self) -> None:
        self.stopping = True
        if self.owns_engine and self._engine is not None:
            self._engine.shutdown()

    def ready_message(self, url: str | None = None) -> str:
        url = url or f"http://{self.config.host}:{self.config.port}"
        return f"radixserve ready: serving {self.served_name} at {url} (OpenAI API at /v1)"

    def describe(self) -> dict[str, Any]:
        return {
            "served_model_name": self.served_name,
            "served_model_names": list(self.served_names),
            "sampling_defaults": self.sampling_defaults,
            "server_config": self.config.redacted(),
            "num_requests_awaiting_grammar": self.metrics.awaiting_grammar,
        }
