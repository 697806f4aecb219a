"""A batch's lines: their form (checked when the batch is validated), the job each asks for (refused
with the error its endpoint would answer), and the result line of each job that ended.

A line is ``{"custom_id", "method": "POST", "url", "body"}``. Its body is validated as its
endpoint validates a request (the same request models and the app's settings), so a line with an
unknown parameter fails with the endpoint's own 400 or 422 envelope; its answer is rendered as
the endpoint answers (``View.completion``, or the job object for ``/v1/jobs``).

The feeder's steps: docs/internals.md#batches-apibatch_feederpy.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from api.auth import check_priority
from api.context_length import ContextCheck
from api.errors import ApiError, body_errors, error_body, validation_error
from api.openai_compat.batches import error_line, response_line
from api.openai_compat.chunks import View, failure
from api.openai_compat.embeddings import EMBEDDINGS, EmbeddingRequest, embedding_response
from api.openai_compat.requests import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from api.openai_compat.response_request import ResponseRequest
from api.openai_compat.responses import ResponseView
from api.served import check_servable, check_with_live_workers, resolve_model
from common.schemas.checks import MAX_JSON_DEPTH, TOO_DEEP, too_deep_message
from common.schemas.events import LogEntry
from common.schemas.requests import JobRequest
from common.schemas.views import JobStatus, WorkerHeartbeat
from common.settings import Settings
from common.store import JobRecord, LineResult

log = logging.getLogger(__name__)

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKET = re.compile(r"[\[\]{}]")
BOM = "\ufeff"  # a file written with a byte order mark starts with it

_OPENAI: dict[str, type[OpenAIRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}


RESPONSES = "/v1/responses"


class LineError(ValueError):
    """A line that is not a request line: the batch fails, naming it (``errors.data``)."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param

    def entry(self, line: int) -> dict[str, Any]:
        return batch_error(self.code, self.message, self.param, line)


def batch_error(code: str, message: str, param: str | None = None, line: int | None = None) -> dict[str, Any]:
    """An entry of a failed batch's ``errors.data``."""
    return {"code": code, "message": message, "param": param, "line": line}


def parse_line(raw: str, endpoint: str) -> dict[str, Any] | None:
    """The request line (None for a blank line), or LineError for one that is none."""
    raw = raw.removeprefix(BOM)
    if not raw.strip():
        return None
    # NOTE: counted before the parse: json.loads itself raises RecursionError on deep enough text.
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise LineError(TOO_DEEP, too_deep_message("this line"))
    try:
        line = json.loads(raw)
    except ValueError as e:
        raise LineError("invalid_json", f"not a JSON object: {e}") from None
    if not isinstance(line, dict):
        raise LineError("invalid_json", "not a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise LineError("missing_custom_id", "custom_id must be a non-empty string", "custom_id")
    if line.get("method") != "POST":
        raise LineError("invalid_method", "method must be POST", "method")
    if line.get("url") != endpoint:
        raise LineError("mismatched_url", f"url must be the batch's endpoint, {endpoint}", "url")
    if not isinstance(line.get("body"), dict):
        raise LineError("invalid_body", "body must be a JSON object", "body")
    extra = sorted(set(line) - {"custom_id", "method", "url", "body"})
    if extra:
        raise LineError("invalid_line", f"unknown field(s): {', '.join(extra)}", extra[0])
    return line


def json_depth(raw: str) -> int:
    """How deep arrays and objects nest in JSON text (its strings skipped)."""
    if raw.count("[") + raw.count("{") <= MAX_JSON_DEPTH:
        return 0  # too few to nest too deep: the common case costs two counts
    depth = deepest = 0
    for c in _BRACKET.findall(_STRING.sub("", raw)):
        depth += 1 if c in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


async def line_request(
    endpoint: str,
    body: dict[str, Any],
    settings: Settings,
    models: Mapping[str, WorkerHeartbeat],
    context: ContextCheck,
    owner: str,
) -> JobRequest:
    """The job a line's body asks for, as its endpoint would accept it from the batch's ``owner``;
    ApiError as it would refuse (a priority below the key's floor included).

    A batch line runs in the background (nobody waits on it) and is never streamed. While no
    worker is live its model is not checked: the line is queued, as a request would be.
    """
    if body.get("stream"):
        raise ApiError(
            400, "stream is not supported in a batch", param="stream", code="unsupported_parameter"
        )
    model = _OPENAI.get(endpoint)
    try:
        if endpoint == EMBEDDINGS:
            embedding = EmbeddingRequest.model_validate(body)
            request = embedding.to_job_request(settings)
            if models:
                check_servable(request, resolve_model(models, embedding.model, embed=True))
        elif model is None and endpoint != RESPONSES:
            request = JobRequest.accept(body, settings)
            check_with_live_workers(models, request)
            await context.check_live(request, models)
        else:
            parsed = (model or ResponseRequest).model_validate(body)
            if isinstance(parsed, ResponseRequest):
                request = parsed.batch_job_request(settings)
            else:
                request = parsed.to_job_request(settings)
            if models:
                worker = resolve_model(models, parsed.model)
                check_servable(request, worker)
                await context.check(request, worker)
    except ValidationError as e:
        raise validation_error(body_errors(e), openai=endpoint != "/v1/jobs") from None
    except RequestValidationError as e:
        raise validation_error(e, openai=endpoint != "/v1/jobs") from None
    check_priority(settings, owner, request.priority)
    return request.model_copy(update={"background": True, "stream": False})


def refused(line: int, custom_id: str, e: ApiError, line_id: str) -> LineResult:
    body = error_body(e.status, e.message, e.param, e.code)
    return LineResult(line, "failed", response_line(line_id, custom_id, e.status, body))


def crashed(line: int, custom_id: str, e: Exception, line_id: str) -> LineResult:
    """A line whose processing raised what no endpoint answers: it fails, saying what, and the
    batch goes on."""
    if isinstance(e, RecursionError):
        error = ApiError(400, too_deep_message("the request"), code=TOO_DEEP)
    else:
        log.error("batch line %d (%s) failed", line, custom_id, exc_info=e)
        error = ApiError(
            500, f"the request could not be processed: {type(e).__name__}", code="internal_error"
        )
    return refused(line, custom_id, error, line_id)


def job_result(
    line: int,
    custom_id: str,
    endpoint: str,
    record: JobRecord,
    model: str,
    ending: str,
    log: Sequence[LogEntry] = (),
    tool_parser: str | None = None,
) -> LineResult:
    """The result line of a line's job that ended, its answer as the endpoint would give it.

    ``log`` is the job's log, passed when its view needs it (``needs_view_log``). ``tool_parser``
    says how its model's tool calls are read (common/tool_calls.py)."""
    job = record.job
    if job.status is JobStatus.CANCELLED:
        code = "batch_expired" if ending == "expired" else "batch_cancelled"
        result = error_line(
            job.id, custom_id, code, f"the batch was {ending or 'cancelled'} before this request ended"
        )
        return LineResult(line, "failed", result, job.id)
    if endpoint == "/v1/jobs":
        body = job.model_dump(mode="json")
        kind = "completed" if job.status is JobStatus.SUCCEEDED else "failed"
        return LineResult(line, kind, response_line(job.id, custom_id, 200, body), job.id)
    assert isinstance(record.request, JobRequest)  # a line is a text job, never an image part
    if endpoint == EMBEDDINGS:
        try:
            body = embedding_response(job, record.request, job.model or model, log)
        except ApiError as e:
            return LineResult(line, "failed", refused(line, custom_id, e, job.id).result, job.id)
        return LineResult(line, "completed", response_line(job.id, custom_id, 200, body), job.id)
    if endpoint == RESPONSES:
        if job.error is not None:
            return LineResult(
                line, "failed", refused(line, custom_id, failure(job.error), job.id).result, job.id
            )
        body = ResponseView.of_line(job, record.request, job.model or model, tool_parser).obj(job)
        return LineResult(line, "completed", response_line(job.id, custom_id, 200, body), job.id)
    view = View.of(job.id, job.created_at, record.request, job.model or model, tool_parser)
    try:
        return LineResult(
            line, "completed", response_line(job.id, custom_id, 200, view.completion(job, log)), job.id
        )
    except ApiError as e:
        return LineResult(line, "failed", refused(line, custom_id, e, job.id).result, job.id)


def needs_view_log(endpoint: str, record: JobRecord) -> bool:
    """Whether the line's result is built from its job's log (logprobs, echo, the choices of n > 1
    or of several prompts, or an embedding job's vectors)."""
    r = record.request
    return (
        endpoint != "/v1/jobs"
        and isinstance(r, JobRequest)
        and (r.logprobs is not None or r.num_choices > 1 or r.echo or r.embed is not None)
    )


def lost_result(line: int, custom_id: str, job_id: str) -> LineResult:
    """The result of a line whose job expired before its result was recorded."""
    return LineResult(
        line, "failed", error_line(job_id, custom_id, "job_expired", "the line's job expired"), job_id
    )
