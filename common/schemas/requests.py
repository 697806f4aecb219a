"""The job request (``JobRequest``): one text generation, or ``parts`` (text and image) in order.
It is stored as JSON in the job hash's ``request`` field (docs/internals.md)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from common.schemas.checks import (
    INVALID_PART,
    INVALID_WEBHOOK,
    MAX_JSON_DEPTH,
    MAX_PRIORITY,
    OUT_OF_RANGE,
    SERVER_SETTINGS,
    STORED_CONTEXT,
    TOO_DEEP,
    ServiceTier,
    check_limit,
    encodable,
    finite,
    nested_too_deep,
    server_settings,
    too_deep_message,
)
from common.schemas.embeddings import EmbedParams
from common.schemas.text import TextParams, TextPart
from common.settings import Settings
from common.webhooks import check_events, check_url_form

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
        return encodable(v)

    @field_validator("guidance_scale", "timeout_s")
    @classmethod
    def _finite_floats(cls, v: float | None) -> float | None:
        return finite(v)

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
        check_limit(
            info,
            w * h,
            lambda s: s.max_image_pixels,
            "size {v} is {px} pixels, above this server's limit of {cap} (SPOOL_MAX_IMAGE_PIXELS)",
            v=v,
            px=w * h,
        )
        return v

    @field_validator("steps")
    @classmethod
    def _steps(cls, v: int, info: ValidationInfo) -> int:
        check_limit(
            info,
            v,
            lambda s: s.max_image_steps,
            "steps is {v}, above this server's limit of {cap} (SPOOL_MAX_IMAGE_STEPS)",
            v=v,
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

    # The served model it runs on (its text parts, with parts); None: the default one (api/served.py).
    model: str | None = Field(None, min_length=1, max_length=256)
    background: bool = True  # the API answers at once; False: it waits for the result
    stream: bool = False  # POST /v1/jobs answers with the job's event stream instead of the job
    user: str | None = Field(None, max_length=256)  # the end user, as the OpenAI API's `user`; stored only
    stream_include_usage: bool = False  # OpenAI stream format: end with a usage chunk (stream_options)
    # vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far.
    stream_continuous_usage: bool = False
    # A multimodal job: its parts in order; each has its own status (common/store/records.py).
    parts: list[Part] | None = Field(None, min_length=1)
    # An embedding job (/v1/embeddings): its inputs, embedded by a worker whose model embeds; it
    # generates nothing, and its terminal event carries the vectors (common/schemas/embeddings.py).
    embed: EmbedParams | None = None
    # Choices: n sequences of the prompt in the batch, one job (docs/internals.md, "Choices").
    n: StrictInt = 1
    # Where to POST the job's events (docs/webhooks.md), and which: start, part, completed.
    webhook: str | None = None
    webhook_events: list[str] | None = None
    # Whose events its webhook sends, a job's or a response's (response.completed, ...). Only
    # POST /v1/responses sets it (``as_response``), never a body.
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

    # Priority tiers (docs/internals.md, "Models and tenants"). OpenAI's service_tier ("flex" is
    # the batch tier, below interactive work) and a number as vLLM's, where lower runs first. A
    # number below SPOOL_PRIORITY_FLOOR is only for the keys SPOOL_TENANT_PRIORITY_FLOORS allows.
    service_tier: ServiceTier = "auto"
    priority: StrictInt = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)

    @field_validator("n")
    @classmethod
    def _n(cls, v: int, info: ValidationInfo) -> int:
        if v < 1:
            raise PydanticCustomError(OUT_OF_RANGE, "n is {value}; it must be at least 1", {"value": v})
        check_limit(
            info,
            v,
            lambda s: s.max_n,
            "n is {value}, above this server's limit of {cap} (SPOOL_MAX_N)",
            value=v,
        )
        return v

    @model_validator(mode="after")
    def _prompts_limit(self, info: ValidationInfo) -> JobRequest:
        if self.prompts is not None:
            check_limit(
                info,
                len(self.prompts) * self.n,
                lambda s: s.max_prompts,
                "{prompts} prompts times n ({n}) is {choices} choices, above this server's limit of "
                "{cap} (SPOOL_MAX_PROMPTS)",
                prompts=len(self.prompts),
                n=self.n,
                choices=len(self.prompts) * self.n,
            )
        return self

    @property
    def num_choices(self) -> int:
        """The job's sequences: n per prompt (docs/internals.md, "Choices")."""
        return self.n * max(len(self.prompt_list), 1)

    @field_validator("user")
    @classmethod
    def _user(cls, v: Any) -> Any:
        return encodable(v)

    def _needs_prompt(self) -> bool:
        return self.parts is None and self.embed is None

    @field_validator("parts")
    @classmethod
    def _parts_limit(cls, v: list[Any] | None, info: ValidationInfo) -> list[Any] | None:
        if v is not None:
            check_limit(
                info,
                len(v),
                lambda s: s.max_parts,
                "the job has {n} parts, above this server's limit of {cap} (SPOOL_MAX_PARTS)",
                n=len(v),
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
        client = server_settings(info) is not None and isinstance(data, dict) and data.get("parts")
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
    def _embed_alone(self) -> JobRequest:
        if self.embed is not None:
            given = [f for f in ("prompt", "messages", "parts", "tools") if getattr(self, f) is not None]
            if given or self.n != 1:
                names = ", ".join(given or ["n"])
                raise ValueError(f"an embedding job (embed) takes no {names}: its inputs are embed.input")
        return self

    @model_validator(mode="after")
    def _parts(self) -> JobRequest:
        if self.parts is None:
            return self
        if self.n != 1:
            raise PydanticCustomError(INVALID_PART, "n is {n}; a job with parts takes n = 1", {"n": self.n})
        for i, part in enumerate(self.parts):
            if isinstance(part, TextPart) and (part.prompts is not None or part.echo):
                raise PydanticCustomError(
                    INVALID_PART, "part {i}: a text part takes one prompt, without echo", {"i": i}
                )
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
        """The request a part runs with. A text part runs as a text job with the job's timeout_s
        unless it has its own, and is foreground if the job is. The job's own watchers then count
        for it (common/store/sync.py ``unwatched``)."""
        assert self.parts is not None
        part = self.parts[index]
        timeout = part.timeout_s if part.timeout_s is not None else self.timeout_s
        if isinstance(part, ImagePart):
            return part.model_copy(update={"timeout_s": timeout})
        fields = part.model_dump(exclude={"type"}, exclude_unset=True)
        return JobRequest.model_validate(  # the part's fields were checked as a part's
            {
                **fields,
                "max_tokens": part.max_tokens,
                "timeout_s": timeout,
                "background": self.background,
                "service_tier": self.service_tier,
                "priority": self.priority,
            },
            context=STORED_CONTEXT,
        )

    @classmethod
    def accept(cls, data: Any, settings: Settings) -> JobRequest:
        """Validate a client's request with the server's default max_tokens and limits."""
        return cls.model_validate(data, context={SERVER_SETTINGS: settings})
