"""Schemas shared by the API and the worker: the job request, job events and the job view.

The JSON of a log entry (``{"seq", "type", "data"}``) is the contract of docs/internals.md; the
encode/decode helpers here are the only code that writes or reads it.
"""

from __future__ import annotations

import enum
import math
from typing import Annotated, Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from common.settings import DEFAULT_MAX_TOKENS, Settings

MAX_STOP_STRINGS = 4
# The validation context's key for the Settings of the server that accepts a request
# (``JobRequest.accept``): its default max_tokens and its limits. Without them (a request read
# back from the store, already judged by the API that accepted it; a tool's own) neither applies.
SERVER_SETTINGS = "settings"
LIMIT_EXCEEDED = "limit_exceeded"  # validation error type of a value above a configured limit (400)
OUT_OF_RANGE = "out_of_range"  # validation error type of a sampling extra outside its range (400, as OpenAI)
MAX_LOGIT_BIAS = 300  # token ids one request may bias
MAX_LOGPROBS = 20  # top logprobs per token (chat's top_logprobs limit)
# The sampling extras' (lowest, highest) values, both included.
_RANGES: dict[str, tuple[float, float]] = {
    "frequency_penalty": (-2, 2),
    "presence_penalty": (-2, 2),
    "logprobs": (0, MAX_LOGPROBS),
    "min_tokens": (0, math.inf),
}


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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str

    @field_validator("content")
    @classmethod
    def _content(cls, v: str) -> str:
        return _encodable(v)  # type: ignore[no-any-return]


def _encodable(v: Any) -> Any:
    # NOTE: JSON's "\ud800" escapes decode to lone surrogates, which no UTF-8 encoder (Redis,
    # the tokenizer) accepts: refuse them here rather than fail later.
    for text in [v] if isinstance(v, str) else v if isinstance(v, list) else []:
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("must be valid Unicode (no unpaired surrogates)") from None
    return v


def _server_settings(info: ValidationInfo) -> Settings | None:
    settings = (info.context or {}).get(SERVER_SETTINGS)
    assert settings is None or isinstance(settings, Settings)
    return settings


def _finite(v: float | None) -> float | None:
    # NOTE: pydantic accepts "nan" and "inf" for floats; a NaN temperature would reach the sampler.
    if v is not None and not math.isfinite(v):
        raise ValueError("must be a finite number")
    return v


INVALID_SCHEMA = "invalid_json_schema"  # validation error type of a response_format schema that is not one (400)


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``."""

    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the output always follows the schema: constrained decoding is strict

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)

    @field_validator("schema_")
    @classmethod
    def _is_a_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        # NOTE: jsonschema, not the grammar compiler: the API imports no torch. What is a valid
        # schema the compiler still cannot use fails the job with invalid_request (a 400 too).
        try:
            jsonschema.validators.validator_for(v).check_schema(v)
        except jsonschema.SchemaError as e:
            where = "/".join(map(str, e.absolute_path)) or "the root"
            raise PydanticCustomError(INVALID_SCHEMA, "not a valid JSON schema at {where}: {error}", {"where": where, "error": e.message}) from None
        return v


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object)
    or ``json_schema`` (JSON that validates against ``json_schema.schema``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError(INVALID_SCHEMA, "json_schema is required with type json_schema, and only then")
        return self

    @property
    def constrained(self) -> bool:
        return self.type != "text"

    @property
    def schema_or_none(self) -> dict[str, Any] | None:
        """The schema the output follows; None with json_object (any object)."""
        return self.json_schema.schema_ if self.json_schema is not None else None


class JobRequest(BaseModel):
    """A validated generation request, stored as JSON in the job hash's ``request`` field."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # The server's SPOOL_DEFAULT_MAX_TOKENS when given its settings (_server_default).
    max_tokens: int = Field(default_factory=lambda: DEFAULT_MAX_TOKENS, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    stop: str | list[Annotated[str, Field(min_length=1)]] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what a torch.Generator can take
    timeout_s: float | None = Field(None, gt=0)  # counted from job creation; past it the job fails
    background: bool = True  # the API answers at once; False: it waits for the result
    stream: bool = False  # POST /v1/jobs answers with the job's event stream instead of the job
    user: str | None = Field(None, max_length=256)  # the end user, as the OpenAI API's `user`; stored only
    stream_include_usage: bool = False  # OpenAI stream format: end with a usage chunk (stream_options)
    # Logits processing (the engine's SamplingParams; docs/openai.md). Neutral by default.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # > 0; 1 changes nothing
    min_tokens: int = 0  # at most max_tokens
    logit_bias: dict[int, float] | None = None  # token id -> -100..100, added to its logit
    logprobs: int | None = None  # each token's logprob and the top this many (0..20); None: none
    response_format: ResponseFormat | None = None  # structured outputs (workers/engine/grammar.py)

    @field_validator("frequency_penalty", "presence_penalty", "logprobs", "min_tokens")
    @classmethod
    def _in_range(cls, v: float | None, info: ValidationInfo) -> float | None:
        low, high = _RANGES[str(info.field_name)]
        if v is not None and not low <= v <= high:
            bounds = f"at least {low}" if high == math.inf else f"between {low} and {high}"
            raise PydanticCustomError(OUT_OF_RANGE, "{name} is {value}; it must be " + bounds, {"name": info.field_name, "value": v})
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty(cls, v: float) -> float:
        if not (math.isfinite(v) and v > 0):
            raise PydanticCustomError(OUT_OF_RANGE, "repetition_penalty is {value}; it must be above 0", {"value": v})
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise PydanticCustomError(OUT_OF_RANGE, "logit_bias has {n} entries; at most {max}", {"n": len(v), "max": MAX_LOGIT_BIAS})
        for token, bias in v.items():
            if token < 0 or not -100 <= bias <= 100:
                raise PydanticCustomError(
                    OUT_OF_RANGE,
                    "logit_bias maps token ids (>= 0) to values between -100 and 100; got {token}: {bias}",
                    {"token": token, "bias": bias},
                )
        return v

    @field_validator("prompt", "stop", "user")
    @classmethod
    def _text(cls, v: Any) -> Any:
        return _encodable(v)

    @field_validator("temperature", "top_p", "timeout_s")
    @classmethod
    def _finite_floats(cls, v: float | None) -> float | None:
        return _finite(v)

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens_cap(cls, v: int, info: ValidationInfo) -> int:
        settings = _server_settings(info)
        if settings is not None and v > (cap := settings.max_tokens_cap):
            # A well-formed request above a limit of this server: the API answers 400, not 422.
            raise PydanticCustomError(
                LIMIT_EXCEEDED,
                "max_tokens is {value}, above this server's cap of {cap} (SPOOL_MAX_TOKENS_CAP)",
                {"value": v, "cap": cap},
            )
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, str) and not v:
            raise ValueError("stop strings must not be empty")
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return v

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> JobRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self

    @model_validator(mode="after")
    def _server_default(self, info: ValidationInfo) -> JobRequest:
        settings = _server_settings(info)
        if settings is not None and "max_tokens" not in self.model_fields_set:
            self.max_tokens = settings.default_max_tokens
        return self

    @model_validator(mode="after")
    def _min_tokens(self) -> JobRequest:
        if self.min_tokens > self.max_tokens:
            raise PydanticCustomError(
                OUT_OF_RANGE,
                "min_tokens is {value}; it must be at most max_tokens ({max_tokens})",
                {"value": self.min_tokens, "max_tokens": self.max_tokens},
            )
        return self

    @classmethod
    def accept(cls, data: Any, settings: Settings) -> JobRequest:
        """Validate a client's request with the server's default max_tokens and limits."""
        return cls.model_validate(data, context={SERVER_SETTINGS: settings})

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


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


class DoneEvent(BaseModel):
    status: JobStatus  # succeeded | cancelled
    finish_reason: str | None  # stop | length | cancelled
    usage: Usage


class ErrorEvent(BaseModel):
    status: Literal[JobStatus.FAILED] = JobStatus.FAILED
    message: str
    type: str  # engine_error | request_too_long | timeout | ...


EventType = Literal["token", "done", "error"]


class LogEntry(BaseModel):
    """One entry of ``{p}:job:{id}:log``; the same JSON is published on the job's channel."""

    seq: int  # consecutive from 1 across all events of the job
    type: EventType
    data: dict[str, Any]

    @property
    def terminal(self) -> bool:
        return self.type != "token"

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
        return cls(seq=seq, type="done", data=event.model_dump(mode="json"))

    @classmethod
    def error(cls, seq: int, event: ErrorEvent) -> LogEntry:
        return cls(seq=seq, type="error", data=event.model_dump(mode="json"))


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


class Job(JobSummary):
    """The job as the API shows it."""

    text: str  # concatenated token texts; partial while running


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
    chat_template: bool | None = None  # the tokenizer has one (messages can be rendered); None: not said
    max_model_len: int | None = None  # prompt + generated tokens per request
    tokenizer: str | None = None  # digest of its tokenizer spec in Redis (Keys.tokenizer); None: none stored
    # The worker process (workers/identity.py): tells a live holder of the name from an earlier run.
    host: str | None = None
    pid: int | None = None
    pid_ns: str | None = None
    instance: str | None = None  # random, new with every process
