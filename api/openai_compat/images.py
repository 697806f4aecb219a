"""OpenAI's Images API (``POST /v1/images/generations``) as a job with image parts.

``n`` images are ``n`` image parts of one job, on the media workers' queue like any other. As for
chat, a parameter Spool does not implement is refused by name (400) unless its value asks for
nothing; ``steps``, ``seed``, ``guidance_scale`` and ``negative_prompt`` are Spool's own (an
OpenAI client sends them with ``extra_body``).

``stream: true`` (as gpt-image-1's) answers the job's ``preview`` events as
``image_generation.partial_image`` events and its end as ``image_generation.completed`` with the
image, each with the job event's id, so ``/v1/jobs/{id}/events?format=openai`` resumes it.

Image parts: docs/internals.md#parts-jobs-of-text-and-image-parts.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from fastapi.sse import ServerSentEvent
from pydantic import Field, StrictInt, ValidationError

from api.errors import ApiError, body_errors, error_body
from api.openai_compat.requests import _Open, _refuse_extras
from api.sse import AsyncRender, Chunk
from common.schemas.checks import LIMIT_EXCEEDED
from common.schemas.events import LogEntry
from common.schemas.requests import MAX_PARTIAL_IMAGES, JobRequest
from common.schemas.views import Job, JobStatus
from common.settings import Settings
from common.store import AsyncJobStore

# OpenAI's parameters whose value here asks for what Spool does anyway.
_NEUTRAL_IMAGE: dict[str, tuple[object, ...]] = {"quality": ("auto", "standard"), "output_format": ("png",)}


class ImageGenerationRequest(_Open):
    prompt: str
    model: str | None = None
    n: StrictInt | None = Field(None, ge=1)
    size: str | None = None  # WxH; none: the image part's default
    response_format: Literal["url", "b64_json"] | None = None  # none: url, as OpenAI's dall-e models
    user: str | None = None
    steps: StrictInt | None = None
    seed: StrictInt | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    stream: bool | None = None
    partial_images: StrictInt | None = None  # previews while it streams, 0 to 3
    webhook: str | None = None  # Spool's: where to POST the job's events (docs/webhooks.md)
    webhook_events: list[str] | None = None

    def to_job_request(self, settings: Settings) -> JobRequest:
        extra = {k: v for k, v in (self.model_extra or {}).items() if v not in _NEUTRAL_IMAGE.get(k, ())}
        _refuse_extras(extra)
        self._check_stream()
        if (n := self.n or 1) > (cap := settings.max_parts):  # checked before n parts are built
            raise ApiError(
                400,
                f"n is {n}, above this server's limit of {cap} images per request (SPOOL_MAX_PARTS)",
                param="n",
                code=LIMIT_EXCEEDED,
            )
        part: dict[str, Any] = {"type": "image", "prompt": self.prompt}
        for name in ("size", "steps", "seed", "guidance_scale", "negative_prompt", "partial_images"):
            if (value := getattr(self, name)) is not None:
                part[name] = value
        # Each image of n its own seed (one seed given: seed, seed + 1, ...), so they differ.
        parts = [{**part, "seed": part["seed"] + i} if "seed" in part else part for i in range(n)]
        fields = {
            "parts": parts,
            "background": False,
            "user": self.user,
            "webhook": self.webhook,
            "webhook_events": self.webhook_events,
        }
        try:
            return JobRequest.accept({k: v for k, v in fields.items() if v is not None}, settings)
        except ValidationError as e:
            raise body_errors(e) from None

    def _check_stream(self) -> None:
        """What a stream cannot do, refused by name (as OpenAI's, a stream is one image in b64_json)."""
        if self.partial_images is not None and not 0 <= self.partial_images <= MAX_PARTIAL_IMAGES:
            raise ApiError(
                400,
                f"partial_images is {self.partial_images}; it must be between 0 and {MAX_PARTIAL_IMAGES}",
                param="partial_images",
                code="invalid_value",
            )
        if not self.stream:
            if self.partial_images:
                raise ApiError(
                    400, "partial_images is only allowed with stream: true", param="partial_images"
                )
            return
        if self.response_format == "url":
            raise ApiError(
                400,
                "response_format 'url' cannot be streamed: a streamed image comes as b64_json",
                param="response_format",
                code="unsupported_parameter",
            )
        if (self.n or 1) > 1:
            raise ApiError(
                400,
                f"n is {self.n}; a stream makes one image (its events do not say which image they are of)",
                param="n",
                code="unsupported_parameter",
            )


def failure(job: Job) -> ApiError:
    """A job that did not make every image: the first failed part's reason."""
    return _failure(job.status.value, job.parts)


def _failure(job_status: str, parts: Sequence[Mapping[str, Any]]) -> ApiError:
    failed = next((p for p in parts if p["status"] != JobStatus.SUCCEEDED.value), None)
    error = (failed or {}).get("error") or {"message": f"the job ended {job_status}", "type": "cancelled"}
    status = 504 if error["type"] == "timeout" else 500
    return ApiError(status, f"Image generation failed: {error['message']}", code=error["type"])


def image_data(job: Job, base_url: str, contents: list[bytes | None], b64: bool) -> list[dict[str, Any]]:
    if b64:
        return [{"b64_json": base64.b64encode(c or b"").decode("ascii")} for c in contents]
    return [{"url": base_url.rstrip("/") + p["url"]} for p in job.parts]


# NOTE: Spool counts no tokens for an image; the completed event's usage (required by the
# client's type) is all zeros.
_NO_USAGE = {
    "input_tokens": 0,
    "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
    "output_tokens": 0,
    "total_tokens": 0,
}


@dataclass(frozen=True)
class ImageStreamView:
    """How a job of image parts streams in the Images API's format."""

    store: AsyncJobStore  # the completed event reads the image
    job_id: str
    created: int  # the job's creation (unix s): every event's created_at, the same when resumed
    sizes: tuple[str, ...]  # each part's WxH

    @classmethod
    def of(cls, store: AsyncJobStore, job_id: str, created_at: float, request: JobRequest) -> ImageStreamView:
        sizes = tuple(p.size for p in request.parts or () if p.type == "image")
        return cls(store, job_id, int(created_at), sizes)

    @property
    def stream(self) -> AsyncRender:
        return AsyncRender(self.render)

    async def render(self, items: Sequence[LogEntry | ServerSentEvent]) -> list[Chunk]:
        """The events of a batch: a preview is a partial image, the end the completed image (or
        the error); the other job events (part status, progress) show nothing."""
        chunks: list[Chunk] = []
        for item in items:
            if not isinstance(item, LogEntry):
                chunks.append(item)  # the relay's own (ping)
            elif item.type == "preview":
                data = item.data
                chunks.append(
                    self._event(
                        item.seq,
                        "image_generation.partial_image",
                        data["part"],
                        b64_json=data["b64_json"],
                        partial_image_index=data["partial_image_index"],
                    )
                )
            elif item.terminal:
                chunks += await self._end(item)
        return chunks

    async def _end(self, entry: LogEntry) -> list[Chunk]:
        status, parts = entry.data.get("status", ""), entry.data.get("parts", [])
        if entry.type == "error":
            err = ApiError(500, f"Image generation failed: {entry.data['message']}", code=entry.data["type"])
        elif status != JobStatus.SUCCEEDED.value:
            err = _failure(status, parts)
        elif (completed := await self._completed(entry.seq, parts)) is not None:
            return completed
        else:  # expired between its done and this read
            err = ApiError(404, f"job {self.job_id!r} expired", code="content_not_found")
        body = error_body(err.status, err.message, err.param, err.code)
        return [ServerSentEvent(id=str(entry.seq), event="error", raw_data=json.dumps(body))]

    async def _completed(self, seq: int, parts: Sequence[Mapping[str, Any]]) -> list[Chunk] | None:
        """Each image's completed event (with the done's id); None once an image has expired."""
        events: list[Chunk] = []
        for p in parts:
            png = await self.store.part_content(self.job_id, p["part"])
            if png is None:
                return None
            b64 = base64.b64encode(png).decode("ascii")
            events.append(
                self._event(seq, "image_generation.completed", p["part"], b64_json=b64, usage=_NO_USAGE)
            )
        return events

    def _event(self, seq: int, kind: str, part: int, **fields: Any) -> ServerSentEvent:
        body = {
            "type": kind,
            **fields,
            "created_at": self.created,
            "size": self.sizes[part],
            "quality": "auto",
            "background": "opaque",
            "output_format": "png",
        }
        return ServerSentEvent(id=str(seq), event=kind, raw_data=json.dumps(body, separators=(",", ":")))
