"""Objects as the API's GET shows them: the job (from its hash and log), the batch (from its hash)
and a worker's heartbeat. The API uses them, and so do the hook workers for a webhook's ``data``
(common/webhooks.py)."""

from __future__ import annotations

import enum
import json
from pathlib import PurePath
from typing import Any, Literal

from pydantic import BaseModel, Field


class JobStatus(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PARTIAL = "partial"  # some parts succeeded, some failed (multimodal jobs)

    @property
    def terminal(self) -> bool:
        return self not in (JobStatus.QUEUED, JobStatus.RUNNING)


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class JobError(BaseModel):
    message: str
    type: str


class JobSummary(BaseModel):
    """The job without its text, as ``GET /v1/jobs`` lists it."""

    id: str
    status: JobStatus
    finish_reason: str | None = None
    usage: Usage
    error: JobError | None = None
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    parts: list[dict[str, Any]] = Field(default_factory=list)  # multimodal parts; empty for text jobs
    model: str | None = None  # the model the worker loaded; None until a worker takes the job
    batch_id: str | None = None  # the batch whose line this job is; None for any other job


class Job(JobSummary):
    """The job as the API shows it."""

    text: str  # concatenated token texts; partial while running
    # Queued: how many jobs its model's workers take before it (AsyncJobStore.queue_position).
    queue_position: int | None = None
    # Queued: seconds until it can be expected to start; None without a basis (no live worker of
    # its model, or none of its jobs ended yet): AsyncJobStore.estimated_start_s.
    estimated_start_s: float | None = None
    # Queued for a model no live worker serves: why it waits, and what becomes of it after
    # SPOOL_UNSERVED_GRACE_S (api/served.py waiting_reason); None otherwise.
    waiting_reason: str | None = None


class JobList(BaseModel):
    """One page of ``GET /v1/jobs``, newest first; the next page is ``?after={last_id}``."""

    object: Literal["list"] = "list"
    data: list[JobSummary]
    first_id: str | None
    last_id: str | None
    has_more: bool


class WorkerHeartbeat(BaseModel):
    name: str
    ts: float  # unix seconds of the last beat
    engine: dict[str, Any]  # engine.stats(): running, waiting, peak_batch_size, ...
    model: str
    # The jobs it runs: text (the {p}.llm queue), image parts, or webhook deliveries ({p}.hooks)
    kind: Literal["text", "media", "hooks"] = "text"
    chat_template: bool | None = None  # the tokenizer has one (messages can be rendered); None: not said
    tool_parser: str | None = None  # how tool calls are read from its output; None: no tools
    max_model_len: int | None = None  # prompt + generated tokens per request (an embedding input's tokens)
    # A model that embeds (/v1/embeddings): the sizes a request's `dimensions` may ask for, its
    # full size first. None: the model generates text.
    embedding_dimensions: list[int] | None = None
    tokenizer: str | None = None  # digest of its tokenizer spec in Redis (Keys.tokenizer); None: none stored
    # The worker process (workers/identity.py): tells a live holder of the name from an earlier run.
    host: str | None = None
    pid: int | None = None
    pid_ns: str | None = None
    instance: str | None = None  # random, new with every process

    def public(self) -> dict[str, Any]:
        """What /readyz and /console-status show anyone, with or without a key: not the part a
        media worker runs (another key's), nor a model's local path (its last component), nor
        the process's host and ids."""
        model = PurePath(self.model).name if self.model.startswith(("/", ".", "~")) else self.model
        engine = {k: v for k, v in self.engine.items() if k != "part"}
        return {
            "name": self.name,
            "kind": self.kind,
            "model": model,
            "ts": self.ts,
            "engine": engine,
            "max_model_len": self.max_model_len,
            "chat_template": self.chat_template,
        }


_TIMESTAMPS = (
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


def int_or_none(v: str | None) -> int | None:
    return int(float(v)) if v else None


def batch_object(h: dict[str, str]) -> dict[str, Any]:
    """The batch as OpenAI's API shows it; ``request_counts`` are live while it runs."""
    errors = json.loads(h["errors"]) if h.get("errors") else None
    return {
        "id": h["id"],
        "object": "batch",
        "endpoint": h["endpoint"],
        "errors": errors,
        "input_file_id": h["input_file_id"],
        "completion_window": h["completion_window"],
        "status": h["status"],
        "output_file_id": h.get("output_file_id") or None,
        "error_file_id": h.get("error_file_id") or None,
        "created_at": int(float(h["created_at"])),
        "expires_at": int_or_none(h.get("expires_at")),
        **{name: int_or_none(h.get(name)) for name in _TIMESTAMPS},
        "request_counts": {
            "total": int(h.get("total") or 0),
            "completed": int(h.get("completed") or 0),
            "failed": int(h.get("failed") or 0),
        },
        "metadata": json.loads(h["metadata"]) if h.get("metadata") else None,
    }
