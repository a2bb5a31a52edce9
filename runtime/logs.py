"""Log formats shared by the front end and the engine process: text, or one JSON object per line.

``current_request_id`` holds the id of the HTTP request being served (set by ``server.request_id``); JSON lines
written while it is set carry it.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("radixserve_request_id", default=None)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the request id when there is one, and the
    exception's traceback when one is logged."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = current_request_id.get()
        if rid is not None:
            entry["request_id"] = rid
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str, log_format: str = "text") -> None:
    """Root logging to stderr at ``level``, as text or JSON lines."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)
    if log_format == "json":
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())


def current_format() -> str:
    """``json`` when the root logger formats JSON lines, else ``text`` (for a child process to do the same)."""
    return "json" if any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers) else "text"
