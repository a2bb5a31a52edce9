"""The HTTP server's own settings. Like ``EngineConfig``, each field is a ``radixserve serve`` flag
(``--field-name``) and an environment variable (``RADIXSERVE_FIELD_NAME``)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOG_LEVELS = ("debug", "info", "warning", "error")


def _opt(default: Any, help: str, choices: tuple[Any, ...] | None = None, secret: bool = False) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, "secret": secret})


LOOPBACK_ORIGINS = tuple(f"{s}://{h}:*" for s in ("http", "https") for h in ("localhost", "127.0.0.1", "[::1]"))


@dataclass(frozen=True)
class CorsConfig:
    """The CORS flags, served by ``server.http_compat`` (a base of ``ServerConfig``, ``RouterConfig`` and
    ``RayServeConfig``). Subclasses call ``check_cors`` from their ``__post_init__``."""

    allowed_origins: tuple[str, ...] = _opt(
        LOOPBACK_ORIGINS,
        "Origins of the web pages that may call the API from a browser (CORS): '*' for any, "
        "https://*.example.com for one label, :* for any port; '' turns CORS off. Default: pages on this machine.",
    )
    allowed_methods: tuple[str, ...] = _opt(("*",), "HTTP methods a cross-origin preflight may ask for (CORS).")
    allowed_headers: tuple[str, ...] = _opt(("*",), "Request headers a cross-origin preflight may ask for (CORS).")
    allow_credentials: bool = _opt(
        False, "Let cross-origin pages send cookies / HTTP auth (CORS); only with origins named, not '*'."
    )

    def check_cors(self) -> None:
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            object.__setattr__(self, name, _items(getattr(self, name), name))
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError(
                "--allow-credentials needs the origins named in --allowed-origins: browsers refuse credentials for '*'"
            )
        for origin in self.allowed_origins:
            if origin != "*" and not re.fullmatch(r"https?://[^/?#\s]+", origin):
                raise ValueError(
                    f"--allowed-origins takes origins like https://app.example.com (scheme and host, no path), "
                    f"'*' or ''; got {origin!r}"
                )

    def origin_regex(self) -> str | None:
        """One regex for the origins given as patterns (with ``*``), None when there are none."""
        patterns = [_pattern_regex(o) for o in self.allowed_origins if o != "*" and "*" in o]
        return "|".join(f"(?:{p})" for p in patterns) or None


def cors_fields(config: CorsConfig) -> dict[str, Any]:
    """``config``'s CORS settings as keyword arguments (to build a ``ServerConfig`` from another config)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(CorsConfig)}


def _items(value: str | tuple[str, ...], name: str) -> tuple[str, ...]:
    """The values of a list flag: '' gives none; vLLM's JSON spelling ('["https://a", "https://b"]') is read."""
    items = [value] if isinstance(value, str) else list(value)
    if len(items) == 1 and items[0].strip().startswith("["):
        try:
            parsed = json.loads(items[0])
        except ValueError:
            raise ValueError(f"--{name.replace('_', '-')}: {items[0]!r} is not a JSON list of strings") from None
        if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
            raise ValueError(f"--{name.replace('_', '-')}: {items[0]!r} is not a JSON list of strings")
        items = parsed
    return tuple(v.strip() for v in items if v.strip())


def _pattern_regex(origin: str) -> str:
    """``https://*.example.com`` -> one DNS label in place of the ``*``; a trailing ``:*``: any port or none."""
    any_port = origin.endswith(":*")
    body = origin[:-2] if any_port else origin
    regex = re.escape(body).replace(r"\*", "[A-Za-z0-9-]+")
    return regex + (r"(?::[0-9]{1,5})?" if any_port else "")


@dataclass(frozen=True)
class ServerConfig(CorsConfig):
    """Where and how the HTTP API is served (and, from ``CorsConfig``, which web pages may call it). Validated in
    ``__post_init__`` (``ValueError`` says what to fix)."""

    host: str = _opt("127.0.0.1", "Address to listen on (0.0.0.0 to accept connections from other machines).")
    port: int = _opt(30000, "TCP port to listen on.")
    api_key: str = _opt(
        "", "If set, the API and admin routes need 'Authorization: Bearer <key>' (not /health, /metrics).", secret=True
    )
    protect_metrics: bool = _opt(False, "With --api-key, /metrics needs the key too.")
    allow_runtime_lora_updating: bool = _opt(
        False,
        "Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (adapters from folders on this machine: "
        "enable only for trusted clients, with --api-key).",
    )
    served_model_name: tuple[str, ...] = _opt(
        (), "Model name(s) clients use; the first is reported in responses. Default: the --model value's last part."
    )
    generation_config: str = _opt(
        "auto",
        "Sampling defaults for parameters a request leaves out: 'auto' reads the model's generation_config.json, "
        "'vllm' uses none (temperature 1, top_p 1), or a folder or file holding a generation_config.json.",
    )
    chat_template: str = _opt("", "A Jinja chat template (a file path or the template text) overriding the model's.")
    reasoning_parser: str = _opt(
        "",
        "The think-section convention of a reasoning model (qwen3, deepseek-r1): the section goes to "
        "reasoning_content / reasoning items / thinking blocks, and a response schema applies after it.",
        ("", "qwen3", "deepseek-r1"),
    )
    reasoning_max_tokens: int = _opt(
        0, "With --reasoning-parser: the most tokens a think section may take before it is closed (0: no cap)."
    )
    responses_store_size: int = _opt(
        1024, "Responses kept for previous_response_id and GET /v1/responses/{id} (oldest dropped first)."
    )
    log_level: str = _opt("info", "Logging verbosity.", LOG_LEVELS)
    log_format: str = _opt(
        "text",
        "text, or json: one JSON object per line, with the request id of lines written for a request.",
        ("text", "json"),
    )
    shutdown_grace_period: float = _opt(
        10.0, "Seconds in-flight requests get to finish after SIGTERM before they are aborted."
    )
    max_body_bytes: int = _opt(16 << 20, "Largest request body accepted; larger ones get 413.")
    max_json_depth: int = _opt(64, "Deepest nesting of arrays/objects accepted in a JSON body; deeper gets 400.")
    request_read_timeout: float = _opt(
        30.0, "Seconds a client may take to send a request's headers and body; slower ones get 408."
    )
    engine_process: bool = _opt(
        True,
        "Run the engine in a process of its own, so the HTTP front end never holds up its steps; "
        "--no-engine-process runs both in one process.",
    )

    def __post_init__(self) -> None:
        if isinstance(self.served_model_name, str):  # one name given as a string (the Python API)
            object.__setattr__(self, "served_model_name", (self.served_model_name,) if self.served_model_name else ())
        self.check_cors()
        if any(not n.strip() for n in self.served_model_name):
            raise ValueError("--served-model-name values must not be empty")
        if self.generation_config not in ("auto", "vllm"):
            if not Path(self.generation_config).expanduser().exists():
                raise ValueError(
                    f"--generation-config must be auto, vllm, or a path to a generation_config.json (or its folder); "
                    f"{self.generation_config!r} does not exist"
                )
            from radixserve.server.generation_defaults import sampling_defaults

            sampling_defaults(self.generation_config, None)  # a file that is missing or not JSON: refused now
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.shutdown_grace_period < 0:
            raise ValueError(f"--shutdown-grace-period must be >= 0 seconds, got {self.shutdown_grace_period}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_json_depth < 8:
            raise ValueError(f"--max-json-depth must be >= 8, got {self.max_json_depth}")
        if self.request_read_timeout <= 0:
            raise ValueError(f"--request-read-timeout must be > 0 seconds, got {self.request_read_timeout}")
        if self.reasoning_parser not in ("", "qwen3", "deepseek-r1"):
            raise ValueError(f"--reasoning-parser must be qwen3 or deepseek-r1, got {self.reasoning_parser!r}")
        if self.reasoning_max_tokens < 0:
            raise ValueError(f"--reasoning-max-tokens must be >= 0 (0: no cap), got {self.reasoning_max_tokens}")
        if self.responses_store_size < 0:
            raise ValueError(f"--responses-store-size must be >= 0, got {self.responses_store_size}")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"--log-format must be text or json, got {self.log_format!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.chat_template:
            load_chat_template(self.chat_template)  # fail at start-up, not at the first chat request

    def redacted(self) -> dict[str, Any]:
        """The config as a dict fit for logs and /server_info: the API key is never shown."""
        return redacted(self)


def redacted(config: Any) -> dict[str, Any]:
    """A config dataclass as a dict fit for logs: each secret field (an API key) reads only "<set>" or ""."""
    d = dataclasses.asdict(config)
    for f in dataclasses.fields(config):
        if f.metadata.get("secret"):
            d[f.name] = "<set>" if d[f.name] else ""
    return d


def load_chat_template(spec: str) -> str:
    """Return the template text of ``spec``: the contents of a file, or ``spec`` itself if it is a template.

    A value that is neither an existing file nor looks like Jinja (``{{``/``{%``) is most likely a mistyped
    path, so it is refused rather than used as a template that would render the same text for every chat.
    """
    if "{{" in spec or "{%" in spec:
        return spec
    path = Path(spec).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    raise ValueError(f"--chat-template {spec!r} is neither a readable file nor Jinja template text")


def default_served_name(model_spec: str) -> str:
    """The name clients see for ``model_spec``: a built-in name as is, a path by its last component."""
    name = Path(model_spec.rstrip("/\\")).name
    return name.removesuffix(".gguf") or model_spec


def check_adapter_names(adapters: Sequence[str], served_names: Sequence[str], model_spec: str) -> None:
    """``ValueError`` when an adapter would be named as the base model (a request could not name either)."""
    taken = sorted(set(adapters) & {*served_names, model_spec})
    if taken:
        raise ValueError(
            f"--lora-modules: the adapter name {taken[0]!r} is a name of the base model (--served-model-name or "
            "--model); give the adapter another name"
        )
