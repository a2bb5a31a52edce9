"""OpenAI-shaped errors: every failure leaves the server as ``{"error": {message, type, param, code}}``.

Invariant: no exception escapes a route as a bare 500. Client mistakes (including pydantic validation errors
and malformed JSON, which FastAPI would answer with 422) become 400; unexpected exceptions become a 500 that
names the exception, and are logged with their traceback. That 500 is made inside the app's middlewares
(``InternalErrors``), so it carries the request id and CORS headers as every other answer does.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve.constrained import GrammarError
from radixserve.runtime.errors import EngineDeadError, EngineOverloadedError
from radixserve.runtime.request import ErrorCode
from radixserve.server.asgi import HttpMiddleware

logger = logging.getLogger("radixserve.server")

RETRY_AFTER_S = 1
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "server_error",
    503: "service_unavailable",
}
# Leading words of SamplingParams/engine validation messages -> the OpenAI parameter they are about.
_OPENAI_PARAMS = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "top_logprobs": "top_logprobs",
    "seed": "seed",
    "stop": "stop",
    "logit_bias": "logit_bias",
    "cache_salt": "cache_salt",
    "priority": "priority",
    "bad_words_ids": "bad_words",
    "at most": "stop",
    "this request needs": "max_tokens",
}


# The same parameters as /generate's sampling_params spell them.
_NATIVE_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "bad_words": "bad_words_ids"}


class APIError(Exception):
    """An error with its HTTP status; raise it from any route or helper."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def request_failed(error: str | None, code: str | None) -> APIError:
    """The error for a request the engine finished with ``FinishReason.ERROR``: 400 when the request itself is at
    fault (its constraint cannot be followed, it is invalid for this engine), 429 when the engine refused it for a
    full queue, else 500."""
    code = code or ErrorCode.ENGINE.value
    if code == ErrorCode.OVERLOADED.value:
        retry = {"Retry-After": str(RETRY_AFTER_S)}
        return APIError(429, f"the server is overloaded: {error}", code=code, headers=retry)
    if ErrorCode(code).client_fault:
        return APIError(400, f"the request cannot be served: {error}", code=code)
    return APIError(500, f"the request failed inside the engine: {error}", code=code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    err_type = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code if code else status}}


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
# Routes that answer in Anthropic's error shape rather than OpenAI's.
ANTHROPIC_PATHS = ("/v1/messages",)


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape: ``{"type": "error", "error": {"type": ..., "message": ...}}``."""
    err_type = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": err_type, "message": message}}


def error_response(path: str, status: int, message: str, param: str | None = None, code: Any = None, headers=None):
    """The error as the API of ``path`` shapes it."""
    if path.startswith(ANTHROPIC_PATHS):
        return JSONResponse(anthropic_error_body(status, message), status_code=status, headers=headers)
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


_GRAMMAR_CODES = {
    "invalid": "invalid_constraint",
    "unsupported": "unsupported_constraint",
    "timeout": "constraint_timeout",
    "too_complex": "constraint_too_complex",
}


def grammar_error(exc: GrammarError, param: str, message: str | None = None) -> APIError:
    """A constraint that could not be compiled: 400 naming the request field it came from, with a code by
    ``exc.kind``; a failure inside the compiler itself (``internal``) is a 500."""
    text = message or str(exc)
    if exc.kind == "internal":
        return APIError(500, f"compiling {param} failed: {text}", param=param, code="constraint_internal_error")
    return APIError(400, f"{param}: {text}", param=param, code=_GRAMMAR_CODES.get(exc.kind, "invalid_constraint"))


def from_engine_error(exc: Exception, native: bool = False) -> APIError:
    """Map what ``Engine.submit`` raises to the status a client should see."""
    if isinstance(exc, EngineOverloadedError):
        return APIError(429, str(exc), code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"the engine is not running: {exc}", code="engine_dead")
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), param=param_of(str(exc), native))
    return internal_error(exc)


def param_of(message: str, native: bool = False) -> str | None:
    """The request parameter an engine validation message is about, under the name the client used."""
    for prefix, name in _OPENAI_PARAMS.items():
        if message.startswith(prefix + " "):
            if not native:
                return name
            if name == "top_logprobs":
                return "top_logprobs_num"
            return "sampling_params." + _NATIVE_NAMES.get(name, name)
    return None


def internal_error(exc: BaseException) -> APIError:
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "bytes"})


def _is_union_tag(part: Any) -> bool:
    """pydantic names the union member an error is about inside its loc ("str", "list[int]", "ContentPart");
    request field names are snake_case, so a tag is never mistaken for one."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part or part[:1].isupper())


def _loc(loc: tuple[Any, ...]) -> str:
    if loc[:1] in (("query",), ("path",), ("header",)) and len(loc) > 1:
        loc = loc[1:]  # a query parameter is named as the client wrote it (``limit``), as OpenAI names it
    parts = [p for p in loc if p != "body" and not _is_union_tag(p)]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def invalid_request(exc: ValueError) -> APIError:
    """A 400 for a request an adapter built from its body and pydantic refused (``exc``), naming the first field
    at fault under the internal request's name (an adapter renames it to its own)."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):  # a validator's own ValueError: its first line is the message
        return bad_request(f"invalid request: {exc}".splitlines()[0])
    return bad_request(*_validation_message(errors()))


def _validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON ({detail}); send a JSON object", None
    if first.get("type") == "missing" and first.get("loc") == ("body",):
        return "the request needs a JSON body", None
    loc = tuple(first.get("loc", ()))
    param = _loc(loc) or None
    msg = first.get("msg", "invalid value")
    if param is None:
        return f"the request body must be a JSON object sent with Content-Type: application/json ({msg})", None
    text = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return text, param


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return error_response(request.url.path, exc.status, exc.message, exc.param, exc.code, exc.headers)

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param = _validation_message(exc.errors())
        return error_response(request.url.path, 400, message, param)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(request.url.path, exc.status_code, str(exc.detail), headers=exc.headers)

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        err = internal_error(exc)
        return error_response(request.url.path, 500, err.message, code=err.code)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)  # what escapes a middleware (Starlette's outermost layer)
    app.add_middleware(InternalErrors)  # the first added: inside every middleware added after


class InternalErrors(HttpMiddleware):
    """ASGI middleware: an unexpected exception of a route becomes the API's 500 here, inside the app's other
    middlewares, so that the answer carries the request id and the CORS headers (Starlette's handler for
    ``Exception`` answers outside them all). Once a response has started, the exception propagates as before
    (the server closes the connection; a stream reports its errors itself)."""

    async def http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        started = False

        async def tracked(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise
            logger.exception("unhandled error in %s %s", scope["method"], scope["path"])
            err = internal_error(exc)
            await error_response(scope["path"], 500, err.message, code=err.code)(scope, receive, send)
