"""OpenAI's Images API (``POST /v1/images/generations``) as a job with image parts.

``n`` images are ``n`` image parts of one job, on the media workers' queue like any other. As for
chat, a parameter Spool does not implement is refused by name (400) unless its value asks for
nothing; ``steps``, ``seed``, ``guidance_scale`` and ``negative_prompt`` are Spool's own (an
OpenAI client sends them with ``extra_body``).
"""

from __future__ import annotations

import base64
from typing import Any, Literal

from pydantic import Field, ValidationError

from api.errors import ApiError, body_errors
from api.openai_compat.requests import _Open, _refuse_extras
from common.schemas import LIMIT_EXCEEDED, Job, JobRequest, JobStatus
from common.settings import Settings

# OpenAI's parameters whose value here asks for what Spool does anyway.
_NEUTRAL_IMAGE: dict[str, tuple[object, ...]] = {"quality": ("auto", "standard"), "output_format": ("png",)}


class ImageGenerationRequest(_Open):
    prompt: str
    model: str | None = None
    n: int | None = Field(None, ge=1)
    size: str | None = None  # WxH; none: the image part's default
    response_format: Literal["url", "b64_json"] | None = None  # none: url, as OpenAI's dall-e models
    user: str | None = None
    steps: int | None = None
    seed: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None

    def to_job_request(self, settings: Settings) -> JobRequest:
        extra = {k: v for k, v in (self.model_extra or {}).items() if v not in _NEUTRAL_IMAGE.get(k, ())}
        _refuse_extras(extra)
        if (n := self.n or 1) > (cap := settings.max_parts):  # checked before n parts are built
            raise ApiError(
                400,
                f"n is {n}, above this server's limit of {cap} images per request (SPOOL_MAX_PARTS)",
                param="n",
                code=LIMIT_EXCEEDED,
            )
        part: dict[str, Any] = {"type": "image", "prompt": self.prompt}
        for name in ("size", "steps", "seed", "guidance_scale", "negative_prompt"):
            if (value := getattr(self, name)) is not None:
                part[name] = value
        # Each image of n its own seed (one seed given: seed, seed + 1, ...), so they differ.
        parts = [{**part, "seed": part["seed"] + i} if "seed" in part else part for i in range(n)]
        fields = {"parts": parts, "background": False, "user": self.user}
        try:
            return JobRequest.accept({k: v for k, v in fields.items() if v is not None}, settings)
        except ValidationError as e:
            raise body_errors(e) from None


def failure(job: Job) -> ApiError:
    """A job that did not make every image: the first failed part's reason."""
    failed = next((p for p in job.parts if p["status"] != JobStatus.SUCCEEDED.value), None)
    error = (failed or {}).get("error") or {
        "message": f"the job ended {job.status.value}",
        "type": "cancelled",
    }
    status = 504 if error["type"] == "timeout" else 500
    return ApiError(status, f"Image generation failed: {error['message']}", code=error["type"])


def image_data(job: Job, base_url: str, contents: list[bytes | None], b64: bool) -> list[dict[str, Any]]:
    if b64:
        return [{"b64_json": base64.b64encode(c or b"").decode("ascii")} for c in contents]
    return [{"url": base_url.rstrip("/") + p["url"]} for p in job.parts]
