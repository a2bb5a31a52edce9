"""The engine's own exceptions, in a module without heavy imports: the front end of an engine process raises
them too, and must not need torch for that."""

from __future__ import annotations


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (``--max-queued-requests``); the caller should retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine has stopped (shutdown or a fatal fault); no request can be served."""
