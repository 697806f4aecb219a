"""Job events. The JSON of a log entry (``{"seq", "type", "data"}``) is the contract of
docs/internals.md; the encode/decode helpers here are the only code that writes or reads it."""

from __future__ import annotations

import base64
from typing import Any, Literal

from pydantic import BaseModel

from common.schemas.views import JobStatus, Usage


class TopLogprob(BaseModel):
    token: str  # the token alone, decoded
    token_id: int
    logprob: float


class TokenLogprob(TopLogprob):
    top: list[TopLogprob]  # the most likely tokens at its position, most likely first


class TokenEvent(BaseModel):
    index: int  # counts token events of the job from 0
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked (absent else)
    # A job with n > 1: the choice (0..n-1) the tokens belong to, and on its last event (which
    # may have no tokens) why that choice ended. Absent for n = 1.
    choice: int | None = None
    finish_reason: str | None = None
    # On a choice's first event, when the request scores its prompt (prompt_logprobs, or echo):
    # one per prompt token, null for the first. Absent else.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_tokens: list[str] | None = None  # with prompt_logprobs: each prompt token alone, decoded


class DoneEvent(BaseModel):
    status: JobStatus  # succeeded | cancelled
    finish_reason: str | None  # stop | length | cancelled
    usage: Usage
    # An embedding job's vectors, one per input in order (base64 of little-endian float32);
    # absent for any other job.
    embeddings: list[str] | None = None


class ErrorEvent(BaseModel):
    status: Literal[JobStatus.FAILED] = JobStatus.FAILED
    message: str
    type: str  # engine_error | request_too_long | timeout | ...


EventType = Literal["token", "done", "error", "part", "progress", "preview"]


class LogEntry(BaseModel):
    """One entry of ``{p}:job:{id}:log``; the same JSON is published on the job's channel."""

    seq: int  # consecutive from 1 across all events of the job
    type: EventType
    data: dict[str, Any]

    @property
    def terminal(self) -> bool:
        return self.type in ("done", "error")

    def encode(self) -> str:
        return self.model_dump_json()

    @classmethod
    def decode(cls, raw: str | bytes) -> LogEntry:
        return cls.model_validate_json(raw)

    @classmethod
    def token(cls, seq: int, event: TokenEvent) -> LogEntry:
        return cls(seq=seq, type="token", data=event.model_dump(mode="json", exclude_none=True))

    @classmethod
    def done(cls, seq: int, event: DoneEvent) -> LogEntry:
        return cls(
            seq=seq,
            type="done",
            data=event.model_dump(mode="json", exclude={"embeddings"} if event.embeddings is None else None),
        )

    @classmethod
    def error(cls, seq: int, event: ErrorEvent) -> LogEntry:
        return cls(seq=seq, type="error", data=event.model_dump(mode="json"))

    @classmethod
    def progress(cls, seq: int, part: int, step: int, steps: int) -> LogEntry:
        return cls(seq=seq, type="progress", data={"part": part, "step": step, "steps": steps})

    @classmethod
    def preview(
        cls, seq: int, part: int, step: int, index: int, png: bytes, width: int, height: int
    ) -> LogEntry:
        """A small PNG of an image part's latents after ``step`` (its ``index``-th preview)."""
        data = {
            "part": part,
            "step": step,
            "partial_image_index": index,
            "content_type": "image/png",
            "width": width,
            "height": height,
            "b64_json": base64.b64encode(png).decode(),
        }
        return cls(seq=seq, type="preview", data=data)

    @classmethod
    def part_status(cls, seq: int, data: dict[str, Any]) -> LogEntry:
        """A part's status change; ``data`` has ``part`` and ``status`` (and, at its end, its result)."""
        return cls(seq=seq, type="part", data=data)
