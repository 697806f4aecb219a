"""What a text generation takes (``TextParams``): a text job's request, or a text part of a job."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from common.schemas.chat import ChatMessage, ResponseFormat, Tool
from common.schemas.checks import (
    INVALID_GUIDED,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    OUT_OF_RANGE,
    check_limit,
    encodable,
    finite,
    guide_size,
    server_settings,
)
from common.settings import DEFAULT_MAX_TOKENS
from common.tool_calls import call_guide

# The sampling extras' (lowest, highest) values, both included.
_RANGES: dict[str, tuple[float, float]] = {
    "frequency_penalty": (-2, 2),
    "presence_penalty": (-2, 2),
    "logprobs": (0, MAX_LOGPROBS),
    "prompt_logprobs": (0, MAX_LOGPROBS),
    "min_tokens": (0, math.inf),
}


# NOTE: integer fields are StrictInt: lax ints took `"steps": true` as 1 (and "5" as 5).
class TextParams(BaseModel):
    """What a text generation takes: a text job's request, or a text part of a job."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | None = None
    # Several prompts (strings or token-id lists), or one of token ids: n choices each, choice
    # i * n + j of prompt i (OpenAI's /v1/completions with a list; docs/internals.md "Choices").
    prompts: list[str | list[Annotated[StrictInt, Field(ge=0)]]] | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # Each prompt token's logprob (null for the first) and the top this many at its position
    # (0..20), from the prefill's logits (vLLM's prompt_logprobs); None: none.
    prompt_logprobs: StrictInt | None = None
    # The prompt's text comes first in each choice's text, and with logprobs its tokens' logprobs
    # first in the choice's (OpenAI's legacy completions' echo).
    echo: bool = False
    # The server's SPOOL_DEFAULT_MAX_TOKENS when given its settings (_server_default); 0 with
    # echo or prompt_logprobs: the prompt is scored, nothing generated.
    max_tokens: StrictInt = Field(default_factory=lambda: DEFAULT_MAX_TOKENS, ge=0)
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
    ignore_eos: bool = False  # vLLM's: EOS does not end the request (stop strings still do)
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

    @field_validator("frequency_penalty", "presence_penalty", "logprobs", "prompt_logprobs", "min_tokens")
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
        guide_size("guided_regex", len(v), info)
        try:
            re.compile(v)
        except re.error as e:
            raise PydanticCustomError(
                INVALID_GUIDED, "guided_regex is not a valid regular expression: {error}", {"error": str(e)}
            ) from None
        return encodable(v)

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
        guide_size("guided_choice", sum(map(len, v)), info, f" in its {len(v)} strings")
        return encodable(v)

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
        """What the output is constrained to, or None for nothing.

        It is ("json", a schema or None for any object), ("regex", pattern), ("choice", strings)
        or ("tool_call", common/tool_calls.py's call_guide), the last for tools with no other
        guide."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools or ()]
        if tools and self.tool_choice not in ("auto", "none"):
            return "tool_call", call_guide(tools, self.tool_choice, self.parallel_tool_calls)
        if self.response_format is not None and self.response_format.constrained:
            return "json", self.response_format.schema_or_none
        if self.guided_regex is not None:
            return "regex", self.guided_regex
        if self.guided_choice is not None:
            return "choice", list(self.guided_choice)
        if tools and self.tool_choice == "auto":
            return "tool_call", call_guide(tools, "auto", self.parallel_tool_calls)
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
        return encodable(v)

    @field_validator("temperature", "top_p", "timeout_s")
    @classmethod
    def _finite_floats(cls, v: float | None) -> float | None:
        return finite(v)

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens_cap(cls, v: int, info: ValidationInfo) -> int:
        if v == 0 and info.data.get("prompt_logprobs") is None and not info.data.get("echo"):
            raise ValueError("max_tokens must be at least 1, or 0 with echo or prompt_logprobs (score only)")
        # A well-formed request above a limit of this server: the API answers 400, not 422.
        check_limit(
            info,
            v,
            lambda s: s.max_tokens_cap,
            "max_tokens is {value}, above this server's cap of {cap} (SPOOL_MAX_TOKENS_CAP)",
            value=v,
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
        given = (self.prompt is not None) + (self.prompts is not None) + (self.messages is not None)
        if self._needs_prompt() and given != 1:
            raise ValueError("give exactly one of prompt, prompts or messages")
        if self.echo and self.messages is not None:
            raise ValueError("echo takes a prompt, not messages")
        return self

    @field_validator("prompts")
    @classmethod
    def _prompts(cls, v: list[str | list[int]] | None) -> list[str | list[int]] | None:
        if v is not None and not all(v):
            raise ValueError("each prompt must be non-empty")
        return encodable(v)

    @property
    def prompt_list(self) -> list[str | list[int]]:
        """The prompts, each its n choices: ``prompts``, or ``[prompt]`` (empty for messages)."""
        if self.prompts is not None:
            return list(self.prompts)
        return [] if self.prompt is None else [self.prompt]

    @property
    def scored_logprobs(self) -> int | None:
        """How many top logprobs each prompt position gets (the worker's engine prompt_logprobs):
        prompt_logprobs, else with echo logprobs' (0 without: echo's text of token-id prompts is
        their tokens'); None: the prompt is not scored."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return (self.logprobs or 0) if self.echo else None

    @model_validator(mode="after")
    def _server_default(self, info: ValidationInfo) -> Self:
        settings = server_settings(info)
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
