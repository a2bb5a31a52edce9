"""Exceptions the DSL raises. A server's refusal keeps the server's own message, status and parameter name."""

from __future__ import annotations


class BackendError(RuntimeError):
    """A backend refused or failed a request.

    ``status`` is the HTTP status the server answered (the in-process backend uses the status the HTTP server would
    have answered for the same request), or ``None`` when the server could not be reached at all. ``message`` is
    the server's message, unchanged, so ``str(exc)`` tells the user what to fix.
    """

    def __init__(
        self, message: str, status: int | None = None, param: str | None = None, code: str | int | None = None
    ) -> None:
        super().__init__(message if status is None else f"[{status}] {message}")
        self.message = message
        self.status = status
        self.param = param
        self.code = code


class ChatTemplateError(ValueError):
    """The served model's chat template cannot express what the program asked for (e.g. it has no system turn)."""
