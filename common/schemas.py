"""Schemas shared by the API and the worker: the job request, job events and the job view.

The JSON of a log entry (``{"seq", "type", "data"}``) is the contract of docs/internals.md; the
encode/decode helpers here are the only code that writes or reads it.
"""

from __future__ import annotations

import base64
import enum
import json
import math
import re
from pathlib import PurePath
from typing import Annotated, Any, Literal, Self, get_args

import jsonschema
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from common.settings import DEFAULT_MAX_TOKENS, Settings
from common.tool_calls import call_schema
from common.webhooks import check_events, check_url_form

MAX_STOP_STRINGS = 4
# Integer fields are StrictInt: lax ints took `"steps": true` as 1 (and "5" as 5).
# The validation context's key for the Settings of the server that accepts a request
# (``JobRequest.accept``): its default max_tokens and its limits. Without them (a request read
# back from the store, already judged by the API that accepted it; a tool's own) neither applies.
SERVER_SETTINGS = "settings"
LIMIT_EXCEEDED = "limit_exceeded"  # validation error type of a value above a configured limit (400)
OUT_OF_RANGE = "out_of_range"  # validation error type of a sampling extra outside its range (400, as OpenAI)
MAX_LOGIT_BIAS = 300  # token ids one request may bias
MAX_LOGPROBS = 20  # top logprobs per token (chat's top_logprobs limit)
MAX_PRIORITY = 100  # a request's priority is within +-this (the batch tier runs below them all)
ServiceTier = Literal["auto", "default", "flex"]  # OpenAI's; "flex" is the batch tier
SERVICE_TIERS: tuple[str, ...] = get_args(ServiceTier)
# The sampling extras' (lowest, highest) values, both included.
_RANGES: dict[str, tuple[float, float]] = {
    "frequency_penalty": (-2, 2),
    "presence_penalty": (-2, 2),
    "logprobs": (0, MAX_LOGPROBS),
    "min_tokens": (0, math.inf),
}
INVALID_PART = "invalid_part"  # validation error type of a job's parts that do not fit together (400)
INVALID_WEBHOOK = "invalid_webhook"  # a webhook URL or webhook_events that cannot be one (400)
INVALID_GUIDED = "invalid_guided_decoding"  # a guided_regex / guided_choice that cannot be one (400)
# Objects and arrays a request may nest, counted from its body. NOTE: the schema check (jsonschema)
# recurses through up to 8 frames a level: 100 levels of response_format raised RecursionError.
MAX_JSON_DEPTH = 64
TOO_DEEP = "json_too_deep"  # validation error type of a request nested deeper than MAX_JSON_DEPTH (400)


def nested_too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``value``'s objects and arrays nest more than ``limit`` levels (``{}`` is one level),
    found without recursion, so a body of any depth can be checked before anything recurses into it."""
    stack = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def too_deep_message(what: str, limit: int = MAX_JSON_DEPTH) -> str:
    return f"{what} nests objects and arrays deeper than this server's limit of {limit} levels"


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


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str  # a JSON object, as text

    @field_validator("arguments")
    @classmethod
    def _object(cls, v: str) -> str:
        try:
            ok = isinstance(json.loads(v), dict)
        except ValueError:
            ok = False
        if not ok:
            raise ValueError("function.arguments must be a JSON object, as text")
        return v


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None  # None only for an assistant message with tool_calls
    tool_calls: list[ToolCall] | None = None  # the assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @field_validator("content")
    @classmethod
    def _content(cls, v: str | None) -> str | None:
        return _encodable(v)  # type: ignore[no-any-return]

    @model_validator(mode="after")
    def _shape(self) -> Self:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (but for an assistant message with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message, and only one, has a tool_call_id")
        return self

    @model_serializer(mode="wrap")
    def _stored_as_sent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A message without tool fields is stored and shown without them (as it was sent)."""
        data: dict[str, Any] = handler(self)
        for name in ("tool_calls", "tool_call_id"):
            if data.get(name) is None:
                data.pop(name, None)
        return data


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionTool


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


def _guide_size(name: str, size: int, info: ValidationInfo, detail: str = "") -> None:
    """A guide above SPOOL_MAX_GUIDE_CHARS: a 400 with its size and the limit (a huge one would
    hold the grammar compiler for minutes)."""
    settings = _server_settings(info)
    if settings is not None and size > (limit := settings.max_guide_chars):
        # NOTE: not "value" and "cap": api/errors.py reads those as a max_tokens past the context.
        raise PydanticCustomError(
            LIMIT_EXCEEDED,
            "{name} is {size} characters{detail}, above this server's limit of {limit} (SPOOL_MAX_GUIDE_CHARS)",
            {"name": name, "size": size, "detail": detail, "limit": limit},
        )


def _finite(v: float | None) -> float | None:
    # NOTE: pydantic accepts "nan" and "inf" for floats; a NaN temperature would reach the sampler.
    if v is not None and not math.isfinite(v):
        raise ValueError("must be a finite number")
    return v


INVALID_SCHEMA = (
    "invalid_json_schema"  # validation error type of a response_format schema that is not one (400)
)


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``."""

    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the output always follows the schema: constrained decoding is strict

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)

    @field_validator("schema_")
    @classmethod
    def _is_a_schema(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        _guide_size(
            "the JSON schema",
            len(json.dumps(v, separators=(",", ":"), ensure_ascii=False)),
            info,
            " as compact JSON",
        )
        # NOTE: jsonschema, not the grammar compiler: the API imports no torch. What is a valid
        # schema the compiler still cannot use fails the job with invalid_request (a 400 too).
        try:
            jsonschema.validators.validator_for(v).check_schema(v)
        except jsonschema.SchemaError as e:
            where = "/".join(map(str, e.absolute_path)) or "the root"
            raise PydanticCustomError(
                INVALID_SCHEMA,
                "not a valid JSON schema at {where}: {error}",
                {"where": where, "error": e.message},
            ) from None
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
            raise PydanticCustomError(
                INVALID_SCHEMA, "json_schema is required with type json_schema, and only then"
            )
        return self

    @property
    def constrained(self) -> bool:
        return self.type != "text"

    @property
    def schema_or_none(self) -> dict[str, Any] | None:
        """The schema the output follows; None with json_object (any object)."""
        return self.json_schema.schema_ if self.json_schema is not None else None


class TextParams(BaseModel):
    """What a text generation takes: a text job's request, or a text part of a job."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # The server's SPOOL_DEFAULT_MAX_TOKENS when given its settings (_server_default).
    max_tokens: StrictInt = Field(default_factory=lambda: DEFAULT_MAX_TOKENS, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=1)
    stop: str | list[Annotated[str, Field(min_length=1)]] | None = None
    seed: StrictInt | None = Field(None, ge=-(2**63), lt=2**64)  # what a torch.Generator can take
    timeout_s: float | None = Field(None, gt=0)  # counted from job creation; past it the job fails
    # Logits processing (the engine's SamplingParams; docs/openai.md). Neutral by default.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0  # > 0; 1 changes nothing
    min_tokens: StrictInt = 0  # at most max_tokens
    logit_bias: dict[int, float] | None = None  # token id -> -100..100, added to its logit
    logprobs: StrictInt | None = None  # each token's logprob and the top this many (0..20); None: none
    response_format: ResponseFormat | None = None  # structured outputs (workers/engine/grammar.py)
    # vLLM's extras, constrained as response_format is: the output matches the regular
    # expression, or is exactly one of the strings. At most one of the three per request.
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    # Function tools, rendered by the chat template; the calls are parsed from the output
    # (common/tool_calls.py). tool_choice: "auto", "none", "required" or one tool's name.
    tools: list[Tool] | None = Field(None, min_length=1)
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True  # false: at most one call

    @field_validator("frequency_penalty", "presence_penalty", "logprobs", "min_tokens")
    @classmethod
    def _in_range(cls, v: float | None, info: ValidationInfo) -> float | None:
        low, high = _RANGES[str(info.field_name)]
        if v is not None and not low <= v <= high:
            bounds = f"at least {low}" if high == math.inf else f"between {low} and {high}"
            raise PydanticCustomError(
                OUT_OF_RANGE, "{name} is {value}; it must be " + bounds, {"name": info.field_name, "value": v}
            )
        return v

    @field_validator("guided_regex")
    @classmethod
    def _guided_regex(cls, v: str | None, info: ValidationInfo) -> str | None:
        # NOTE: Python's re, not the grammar compiler (the API imports no torch): a pattern both
        # accept almost always; one xgrammar alone refuses fails the job with invalid_request.
        if v is None:
            return v
        if not v:
            raise PydanticCustomError(INVALID_GUIDED, "guided_regex is empty")
        _guide_size("guided_regex", len(v), info)
        try:
            re.compile(v)
        except re.error as e:
            raise PydanticCustomError(
                INVALID_GUIDED, "guided_regex is not a valid regular expression: {error}", {"error": str(e)}
            ) from None
        return _encodable(v)  # type: ignore[no-any-return]

    @field_validator("guided_choice")
    @classmethod
    def _guided_choice(cls, v: list[str] | None, info: ValidationInfo) -> list[str] | None:
        if v is None:
            return v
        if not v:
            raise PydanticCustomError(INVALID_GUIDED, "guided_choice is empty; give at least one string")
        if not all(v):
            raise PydanticCustomError(
                INVALID_GUIDED, "guided_choice has an empty string; each must be non-empty"
            )
        _guide_size("guided_choice", sum(map(len, v)), info, f" in its {len(v)} strings")
        return _encodable(v)  # type: ignore[no-any-return]

    @model_validator(mode="after")
    def _one_guide(self) -> Self:
        given = [
            name
            for name, on in (
                ("response_format", self.response_format is not None and self.response_format.constrained),
                ("guided_regex", self.guided_regex is not None),
                ("guided_choice", self.guided_choice is not None),
            )
            if on
        ]
        if len(given) > 1:
            raise PydanticCustomError(
                INVALID_GUIDED, "give at most one of {names}", {"names": ", ".join(given)}
            )
        return self

    @property
    def guide(self) -> tuple[str, Any] | None:
        """What the output is constrained to: ("json", schema or None for any object), ("regex",
        pattern), ("choice", strings) or ("tool_call", the schema of one call: a required or
        named tool_choice); None: nothing."""
        if self.tools is not None and self.tool_choice not in ("auto", "none"):
            tools = [t.model_dump(exclude_none=True) for t in self.tools]
            return "tool_call", call_schema(
                tools, None if self.tool_choice == "required" else self.tool_choice
            )
        if self.response_format is not None and self.response_format.constrained:
            return "json", self.response_format.schema_or_none
        if self.guided_regex is not None:
            return "regex", self.guided_regex
        if self.guided_choice is not None:
            return "choice", list(self.guided_choice)
        return None

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty(cls, v: float) -> float:
        if not (math.isfinite(v) and v > 0):
            raise PydanticCustomError(
                OUT_OF_RANGE, "repetition_penalty is {value}; it must be above 0", {"value": v}
            )
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise PydanticCustomError(
                OUT_OF_RANGE,
                "logit_bias has {n} entries; at most {max}",
                {"n": len(v), "max": MAX_LOGIT_BIAS},
            )
        for token, bias in v.items():
            if token < 0 or not -100 <= bias <= 100:
                raise PydanticCustomError(
                    OUT_OF_RANGE,
                    "logit_bias maps token ids (>= 0) to values between -100 and 100; got {token}: {bias}",
                    {"token": token, "bias": bias},
                )
        return v

    @field_validator("prompt", "stop")
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

    def _needs_prompt(self) -> bool:
        return True

    @model_validator(mode="after")
    def _tools(self) -> Self:
        names = [t.function.name for t in self.tools or ()]
        if self.tools is not None and self.messages is None:
            raise ValueError("tools need messages (a chat)")
        if len(set(names)) < len(names):
            raise ValueError("tools must have distinct names")
        if self.tool_choice not in ("auto", "none", "required", *names):
            raise ValueError(f"tool_choice {self.tool_choice!r} is not auto, none, required or a tool's name")
        if self.tool_choice not in ("auto", "none") and (
            self.response_format is not None
            or self.guided_regex is not None
            or self.guided_choice is not None
        ):
            raise ValueError("a required or named tool_choice cannot be combined with a guide")
        return self

    @property
    def tools_on(self) -> bool:
        """The tools are rendered and calls parsed (tool_choice "none": neither)."""
        return self.tools is not None and self.tool_choice != "none"

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> Self:
        if self._needs_prompt() and (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self

    @model_validator(mode="after")
    def _server_default(self, info: ValidationInfo) -> Self:
        settings = _server_settings(info)
        if settings is not None and "max_tokens" not in self.model_fields_set:
            self.max_tokens = settings.default_max_tokens
        return self

    @model_validator(mode="after")
    def _min_tokens(self) -> Self:
        if self.min_tokens > self.max_tokens:
            raise PydanticCustomError(
                OUT_OF_RANGE,
                "min_tokens is {value}; it must be at most max_tokens ({max_tokens})",
                {"value": self.min_tokens, "max_tokens": self.max_tokens},
            )
        return self

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class TextPart(TextParams):
    """A text part of a job: it joins the continuous batch as a text job does."""

    type: Literal["text"]


MAX_PARTIAL_IMAGES = 3  # as OpenAI's partial_images
_SIZE = re.compile(r"^([1-9][0-9]{0,5})x([1-9][0-9]{0,5})$")


class ImagePart(BaseModel):
    """An image part of a job, run by a media worker's diffusers pipeline."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["image"]
    prompt: str | None = Field(None, min_length=1, max_length=4000)
    prompt_from: StrictInt | None = Field(None, ge=0)  # an earlier text part whose final text is the prompt
    size: str = "256x256"  # WxH, each a multiple of 8 (the VAE's scale)
    steps: StrictInt = Field(20, ge=1)
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)  # none: one drawn from the part's id, and reported
    guidance_scale: float | None = Field(None, ge=0, le=50)  # none: the pipeline's default
    negative_prompt: str | None = Field(None, max_length=4000)
    timeout_s: float | None = Field(None, gt=0)  # counted from job creation; past it the part fails
    # Previews while it denoises (OpenAI's partial_images): a `preview` event each, off by default.
    partial_images: StrictInt = Field(0, ge=0, le=MAX_PARTIAL_IMAGES)

    @field_validator("prompt", "negative_prompt")
    @classmethod
    def _text(cls, v: Any) -> Any:
        return _encodable(v)

    @field_validator("guidance_scale", "timeout_s")
    @classmethod
    def _finite_floats(cls, v: float | None) -> float | None:
        return _finite(v)

    @field_validator("size")
    @classmethod
    def _size(cls, v: str, info: ValidationInfo) -> str:
        m = _SIZE.match(v)
        if not m:
            raise PydanticCustomError(
                INVALID_PART, "size must be WIDTHxHEIGHT, e.g. 256x256; got {got}", {"got": repr(v)}
            )
        w, h = int(m[1]), int(m[2])
        if w % 8 or h % 8:
            raise PydanticCustomError(
                INVALID_PART, "size {v} is not a multiple of 8 in both dimensions", {"v": v}
            )
        settings = _server_settings(info)
        if settings is not None and w * h > (cap := settings.max_image_pixels):
            raise PydanticCustomError(
                LIMIT_EXCEEDED,
                "size {v} is {px} pixels, above this server's limit of {cap} (SPOOL_MAX_IMAGE_PIXELS)",
                {"v": v, "px": w * h, "cap": cap},
            )
        return v

    @field_validator("steps")
    @classmethod
    def _steps(cls, v: int, info: ValidationInfo) -> int:
        settings = _server_settings(info)
        if settings is not None and v > (cap := settings.max_image_steps):
            raise PydanticCustomError(
                LIMIT_EXCEEDED,
                "steps is {v}, above this server's limit of {cap} (SPOOL_MAX_IMAGE_STEPS)",
                {"v": v, "cap": cap},
            )
        return v

    @model_validator(mode="after")
    def _one_prompt(self) -> ImagePart:
        if (self.prompt is None) == (self.prompt_from is None):
            raise PydanticCustomError(
                INVALID_PART, "an image part takes exactly one of prompt or prompt_from"
            )
        return self

    @property
    def width(self) -> int:
        return int(self.size.split("x")[0])

    @property
    def height(self) -> int:
        return int(self.size.split("x")[1])


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]
# Top-level text parameters a job with parts must give inside its text parts instead.
_TEXT_ONLY = frozenset(TextParams.model_fields) - {"timeout_s"}


class JobRequest(TextParams):
    """A validated job request, stored as JSON in the job hash's ``request`` field: one text
    generation (``prompt`` or ``messages``), or ``parts``."""

    background: bool = True  # the API answers at once; False: it waits for the result
    stream: bool = False  # POST /v1/jobs answers with the job's event stream instead of the job
    user: str | None = Field(None, max_length=256)  # the end user, as the OpenAI API's `user`; stored only
    stream_include_usage: bool = False  # OpenAI stream format: end with a usage chunk (stream_options)
    # A multimodal job: its parts in order; each has its own status (common/store/records.py).
    parts: list[Part] | None = Field(None, min_length=1)
    # Choices: n sequences of the prompt in the batch, one job (docs/internals.md, "Choices").
    n: StrictInt = 1
    # Where to POST the job's events (docs/webhooks.md), and which: start, part, completed.
    webhook: str | None = None
    webhook_events: list[str] | None = None
    # Whose events its webhook sends: a job's, or a response's (response.completed, ...): set by
    # POST /v1/responses only (``as_response``), never by a body.
    _events_of: str = PrivateAttr("job")
    # Its owner's server-wide webhook endpoints (POST /v1/webhook_endpoints), set at submit.
    _endpoints: list[dict[str, Any]] = PrivateAttr(default_factory=list)

    def as_response(self) -> JobRequest:
        """This request as a response's: its webhook sends response.* events."""
        self._events_of = "response"
        return self

    def with_endpoints(self, endpoints: list[dict[str, Any]]) -> JobRequest:
        """This request with its owner's endpoints: each receives its events too."""
        self._endpoints = endpoints
        return self

    @property
    def events_of(self) -> str:
        return self._events_of

    @property
    def endpoints(self) -> list[dict[str, Any]]:
        return self._endpoints

    @field_validator("webhook")
    @classmethod
    def _webhook(cls, v: str | None) -> str | None:
        try:
            return v if v is None else check_url_form(v)
        except ValueError as e:
            raise PydanticCustomError(INVALID_WEBHOOK, "{why}", {"why": str(e)}) from None

    @field_validator("webhook_events")
    @classmethod
    def _webhook_events(cls, v: list[str] | None) -> list[str] | None:
        try:
            return v if v is None else check_events(v)
        except ValueError as e:
            raise PydanticCustomError(INVALID_WEBHOOK, "{why}", {"why": str(e)}) from None

    @model_validator(mode="after")
    def _events_need_webhook(self) -> JobRequest:
        if self.webhook_events is not None and self.webhook is None:
            raise PydanticCustomError(INVALID_WEBHOOK, "webhook_events needs a webhook", {})
        return self

    # Priority tiers (docs/internals.md, "Models and tenants"): OpenAI's service_tier ("flex": the
    # batch tier, below interactive work) and a number as vLLM's (lower runs first; below
    # SPOOL_PRIORITY_FLOOR only for the keys SPOOL_TENANT_PRIORITY_FLOORS allows).
    service_tier: ServiceTier = "auto"
    priority: StrictInt = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)

    @field_validator("n")
    @classmethod
    def _n(cls, v: int, info: ValidationInfo) -> int:
        if v < 1:
            raise PydanticCustomError(OUT_OF_RANGE, "n is {value}; it must be at least 1", {"value": v})
        settings = _server_settings(info)
        if settings is not None and v > (cap := settings.max_n):
            raise PydanticCustomError(
                LIMIT_EXCEEDED,
                "n is {value}, above this server's limit of {cap} (SPOOL_MAX_N)",
                {"value": v, "cap": cap},
            )
        return v

    @field_validator("user")
    @classmethod
    def _user(cls, v: Any) -> Any:
        return _encodable(v)

    def _needs_prompt(self) -> bool:
        return self.parts is None

    @field_validator("parts")
    @classmethod
    def _parts_limit(cls, v: list[Any] | None, info: ValidationInfo) -> list[Any] | None:
        settings = _server_settings(info)
        if v is not None and settings is not None and len(v) > (cap := settings.max_parts):
            raise PydanticCustomError(
                LIMIT_EXCEEDED,
                "the job has {n} parts, above this server's limit of {cap} (SPOOL_MAX_PARTS)",
                {"n": len(v), "cap": cap},
            )
        return v

    @model_validator(mode="before")
    @classmethod
    def _depth(cls, data: Any) -> Any:
        # Before any field is validated: the schema check recurses (MAX_JSON_DEPTH).
        for name, value in data.items() if isinstance(data, dict) else ():
            if nested_too_deep(value, MAX_JSON_DEPTH - 1):
                raise PydanticCustomError(TOO_DEEP, "{message}", {"message": too_deep_message(str(name))})
        return data

    @model_validator(mode="before")
    @classmethod
    def _text_in_parts(cls, data: Any, info: ValidationInfo) -> Any:
        # A client's request only: a stored one holds every field (the text ones unused).
        client = _server_settings(info) is not None and isinstance(data, dict) and data.get("parts")
        given = sorted(_TEXT_ONLY & set(data)) if client else []
        if given:
            raise PydanticCustomError(
                INVALID_PART, "with parts, give {names} inside a text part", {"names": ", ".join(given)}
            )
        return data

    @model_validator(mode="after")
    def _tools_n(self) -> JobRequest:
        if self.tools is not None and self.n != 1:
            raise ValueError("tools take n = 1")
        return self

    @model_validator(mode="after")
    def _parts(self) -> JobRequest:
        if self.parts is None:
            return self
        if self.n != 1:
            raise PydanticCustomError(INVALID_PART, "n is {n}; a job with parts takes n = 1", {"n": self.n})
        for i, part in enumerate(self.parts):
            if isinstance(part, ImagePart) and part.prompt_from is not None:
                j = part.prompt_from
                if j >= i:
                    raise PydanticCustomError(
                        INVALID_PART,
                        "part {i}: prompt_from {j} must name an earlier part",
                        {"i": i, "j": j},
                    )
                if not isinstance(self.parts[j], TextPart):
                    raise PydanticCustomError(
                        INVALID_PART,
                        "part {i}: prompt_from {j} names an image part, not a text part",
                        {"i": i, "j": j},
                    )
        return self

    def part_request(self, index: int) -> JobRequest | ImagePart:
        """The request a part runs with: a text part as a text job, foreground if the job is (the
        job's own watchers count for it: common/store/sync.py ``unwatched``), with the job's
        timeout_s unless it has its own."""
        assert self.parts is not None
        part = self.parts[index]
        timeout = part.timeout_s if part.timeout_s is not None else self.timeout_s
        if isinstance(part, ImagePart):
            return part.model_copy(update={"timeout_s": timeout})
        fields = part.model_dump(exclude={"type"}, exclude_unset=True)
        return JobRequest.model_validate(
            {
                **fields,
                "max_tokens": part.max_tokens,
                "timeout_s": timeout,
                "background": self.background,
                "service_tier": self.service_tier,
                "priority": self.priority,
            }
        )

    @classmethod
    def accept(cls, data: Any, settings: Settings) -> JobRequest:
        """Validate a client's request with the server's default max_tokens and limits."""
        return cls.model_validate(data, context={SERVER_SETTINGS: settings})


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
    # A job with n > 1: the choice (0..n-1) the tokens belong to, and on its last event (which
    # may have no tokens) why that choice ended. Absent for n = 1.
    choice: int | None = None
    finish_reason: str | None = None


class DoneEvent(BaseModel):
    status: JobStatus  # succeeded | cancelled
    finish_reason: str | None  # stop | length | cancelled
    usage: Usage


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
        return cls(seq=seq, type="done", data=event.model_dump(mode="json"))

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
    max_model_len: int | None = None  # prompt + generated tokens per request
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
