"""The one error envelope, ``{"error": {"message", "type", "param", "code"}}``, for every error.

Handlers map FastAPI's own errors (HTTPException, request validation, the body-size limit) and
infrastructure failures (Redis or the Celery broker unreachable, Redis refusing writes) into it,
so a client parses one shape whatever went wrong.

Each status and its type: docs/internals.md#api-process-api.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from common.redis_errors import UNREACHABLE, WRITE_REFUSED
from common.schemas.checks import (
    INVALID_GUIDED,
    INVALID_PART,
    INVALID_SCHEMA,
    INVALID_WEBHOOK,
    LIMIT_EXCEEDED,
    OUT_OF_RANGE,
    TOO_DEEP,
    too_deep_message,
)
from common.store import Conflict, JobNotFound

# OpenAI-style error types, so clients written against that API branch on familiar names.
_TYPES: Mapping[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}
WRITE_REFUSED_TYPE = "redis_write_refused_error"  # a 503 whose cause a client may want to tell apart
RETRY_AFTER_S = 1  # Redis back, or taking writes again: usually seconds


class ApiError(Exception):
    """Raised by routes and dependencies; rendered as the envelope with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        error_type: str | None = None,  # else the status's (_TYPES)
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        self.error_type = error_type


def body_errors(e: ValidationError, renamed: Mapping[str, str] | None = None) -> RequestValidationError:
    """A body's validation errors, located as FastAPI locates its own (``renamed``: field -> name
    the client sent), for the same envelope and status."""
    names = renamed or {}
    return RequestValidationError(
        [{**err, "loc": ("body", *(names.get(str(p), p) for p in err["loc"]))} for err in e.errors()]
    )


def error_body(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    error_type: str | None = None,
) -> dict[str, Any]:
    kind = error_type or _TYPES.get(status, "api_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _respond(err: ApiError) -> JSONResponse:
    body = error_body(err.status, err.message, err.param, err.code, err.error_type)
    return JSONResponse(body, err.status, err.headers)


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return _respond(exc)


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    if isinstance(exc.__cause__, RecursionError):  # FastAPI's "error parsing the body": json.loads
        return _respond(ApiError(400, too_deep_message("The body"), code=TOO_DEEP))
    code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(exc.status_code)
    return _respond(ApiError(exc.status_code, str(exc.detail), code=code, headers=exc.headers))


def _location(loc: Sequence[int | str]) -> str | None:
    # ("body", "messages", 0, "role") -> "messages.0.role"; the "body"/"query" root says nothing.
    parts = (
        [str(p) for p in loc[1:]]
        if loc and loc[0] in ("body", "query", "path", "header")
        else list(map(str, loc))
    )
    return ".".join(parts) or None


def openai_route(path: str) -> bool:
    """The OpenAI-compatible routes: everything under /v1/ but Spool's own jobs API."""
    return path.startswith("/v1/") and not path.startswith("/v1/jobs")


def validation_error(exc: RequestValidationError, openai: bool = False) -> ApiError:
    """How a request's validation errors answer (also a batch line's: api/batch_lines.py).
    ``openai``: an OpenAI route's, where a schema violation is a 400 (as OpenAI and vLLM answer
    ``top_p: 3``), not the jobs API's 422."""
    errors = exc.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        # Not JSON at all: a malformed request (400) rather than a schema violation (422).
        return ApiError(400, f"Body is not valid JSON: {first['ctx']['error']}", code="invalid_json")
    message = "; ".join(f"{_location(e['loc']) or 'body'}: {e['msg']}" for e in errors)
    # Valid in form but above a limit of this server (e.g. SPOOL_MAX_TOKENS_CAP), or a sampling
    # extra (penalties, logit_bias, logprobs) outside its range, or a response_format schema that
    # is not one, as OpenAI answers them: 400, with the numbers or what is wrong. A job's parts
    # that do not fit (an unknown type, prompt_from forward, a bad size): 400 too.
    bad_parts = first["type"] == INVALID_PART or first["loc"][1:2] == ("parts",)
    refused = (LIMIT_EXCEEDED, OUT_OF_RANGE, INVALID_SCHEMA, INVALID_GUIDED, TOO_DEEP, INVALID_WEBHOOK)
    status = 400 if first["type"] in refused or bad_parts or openai else 422
    return ApiError(status, message, param=_location(first["loc"]), code=str(first["type"]))


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0]
    if first["type"] == LIMIT_EXCEEDED and (context := await _past_the_context(request, first)):
        return _respond(context)
    return _respond(validation_error(exc, openai=openai_route(request.url.path)))


async def _past_the_context(request: Request, error: Mapping[str, Any]) -> ApiError | None:
    """max_tokens above SPOOL_MAX_TOKENS_CAP and past the served model's context too: the error
    names the model's limit (the smaller, so one error says how far to go), and the cap."""
    services = getattr(request.app.state, "services", None)
    value, cap = error.get("ctx", {}).get("value"), error.get("ctx", {}).get("cap")
    if services is None or not isinstance(value, int):
        return None
    limits = [w.max_model_len for w in (await services.served.get()).values() if w.max_model_len]
    if not limits or value < min(limits):
        return None
    limit = min(limits)
    return ApiError(
        400,
        f"This model's maximum context length is {limit} tokens, for the prompt and the completion "
        f"together; {_location(error['loc'])} is {value} (and this server's cap, SPOOL_MAX_TOKENS_CAP, "
        f"is {cap}). Ask for fewer than {limit} tokens.",
        param=_location(error["loc"]),
        code="context_length_exceeded",
    )


async def _not_found(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, JobNotFound)
    return _respond(
        ApiError(
            404, f"No job with id {exc.job_id!r} (unknown, or expired)", param="job_id", code="job_not_found"
        )
    )


async def _conflict(_: Request, exc: Exception) -> JSONResponse:
    return _respond(ApiError(409, str(exc), param="job_id", code="conflict"))


async def _backend_down(_: Request, exc: Exception) -> JSONResponse:
    return _respond(
        ApiError(
            503,
            f"Service unavailable: Redis is unreachable ({exc})",
            code="backend_unavailable",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    )


def write_refused(exc: Exception) -> ApiError:
    """Redis is up and refuses writes (out of memory, or a read-only replica): it passes."""
    return ApiError(
        503,
        f"Service unavailable: Redis refused the write ({exc}); retry later",
        code="redis_write_refused",
        error_type=WRITE_REFUSED_TYPE,
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


async def _write_refused(_: Request, exc: Exception) -> JSONResponse:
    return _respond(write_refused(exc))


async def _internal(_: Request, exc: Exception) -> JSONResponse:
    # Starlette logs the traceback; the client gets the envelope, without internals.
    return _respond(ApiError(500, "Internal server error", code="internal_error"))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(JobNotFound, _not_found)
    app.add_exception_handler(Conflict, _conflict)
    for exc in UNREACHABLE:
        app.add_exception_handler(exc, _backend_down)
    # NOTE: without a handler of their own these were 500s, and an exception left to the last
    # resort also makes uvicorn drop the keep-alive connection.
    for exc in WRITE_REFUSED:
        app.add_exception_handler(exc, _write_refused)
    app.add_exception_handler(Exception, _internal)  # the last resort, answered as a 500
