"""OpenAI request bodies, and their translation into a ``JobRequest``.

Nothing is silently dropped: a parameter Spool does not implement is refused with a 400 that
names it, unless its value asks for nothing (null, or OpenAI's own neutral value such as
``"frequency_penalty": 0``), which many clients send by default.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError

from api.errors import ApiError, body_errors
from common.schemas.checks import MAX_LOGPROBS, SERVICE_TIERS, TOO_DEEP, too_deep_message
from common.schemas.requests import JobRequest
from common.settings import Settings

# Values of unsupported parameters that change nothing, so a client sending them is served
# (the clients' defaults: docs/openai.md, "Values that ask for nothing").
_NEUTRAL: dict[str, object] = {
    "echo": False,  # chat's (completions take echo)
    "best_of": 1,
    "functions": [],
    "store": False,
    "metadata": {},
    "include": [],  # the OpenAI Agents SDK sends it on every Responses call
    "top_logprobs": 0,  # (Responses and completions: chat has its own)
    "prompt_cache_retention": "in_memory",
    "include_obfuscation": False,  # stream_options': Spool pads no stream event
}
# Parameters whose value is an object that asks for nothing when every field in it is null:
# `"reasoning": {}` or `{"effort": null, "summary": null}` (a model that does not reason).
_EMPTY_OBJECTS = frozenset({"reasoning"})
COMPLETION_MAX_LOGPROBS = 5  # OpenAI's limit for /v1/completions' logprobs
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def _neutral(name: str, value: object) -> bool:
    if value is None:
        return True
    if name in _EMPTY_OBJECTS:
        return isinstance(value, dict) and all(v is None for v in value.values())
    if name not in _NEUTRAL:
        return False
    want = _NEUTRAL[name]
    return isinstance(value, bool) == isinstance(want, bool) and value == want


def _refuse_extras(extra: dict[str, Any] | None, where: str = "") -> None:
    for name, value in (extra or {}).items():
        if not _neutral(name, value):
            raise ApiError(
                400,
                f"Unsupported parameter: '{where}{name}' is not supported by Spool",
                param=f"{where}{name}",
                code="unsupported_parameter",
            )


def service_tier(tier: str | None) -> str | None:
    """OpenAI's service tier as Spool serves it (auto and default interactive, flex the batch tier)."""
    if tier not in (None, *SERVICE_TIERS):
        raise ApiError(
            400,
            f"service_tier {tier!r} is not served here; give one of {', '.join(SERVICE_TIERS)}",
            param="service_tier",
            code="unsupported_value",
        )
    return tier


class _Open(BaseModel):
    # Unknown fields are kept so they can be refused by name with a 400 (not a bare 422).
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Open):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage on every chunk


class TextPart(_Open):
    type: str
    text: str | None = None


class Message(_Open):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # validated as JobRequest's ToolCall
    tool_call_id: str | None = None


class OpenAIRequest(_Open):
    """What completions and chat completions share. ``background`` and ``top_k`` are Spool's."""

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    n: StrictInt | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    background: bool = False  # a stream that runs to the end even when its client goes away
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extra (transformers'), as min_tokens
    min_tokens: StrictInt | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, JSON's keys) -> bias
    response_format: dict[str, Any] | None = None  # validated as JobRequest's ResponseFormat
    # vLLM's guided decoding extras: guided_json is response_format's json_schema by another name.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    webhook: str | None = None  # Spool's: where to POST the job's events (docs/webhooks.md)
    webhook_events: list[str] | None = None
    service_tier: str | None = None  # OpenAI's: auto and default (interactive), flex (the batch tier)
    priority: int | None = None  # vLLM's: lower runs first
    ignore_eos: bool | None = None  # vLLM's: generate to max_tokens past EOS (benchmarks)
    # OpenAI's hint for its prompt cache; Spool's prefix cache finds shared prefixes by their
    # tokens, so any key is served and changes nothing.
    prompt_cache_key: str | None = None
    # vLLM's: each prompt token's logprob and the top this many (0..20), on /v1/jobs' events
    # and the job's log (docs/openai.md "Scoring").
    prompt_logprobs: StrictInt | None = None

    def prompt_fields(self) -> dict[str, Any]:
        raise NotImplementedError

    def logprobs_field(self) -> int | None:
        """How many top logprobs per token the job returns; None: no logprobs."""
        raise NotImplementedError

    def max_tokens_field(self) -> tuple[str, int | None]:
        return "max_tokens", self.max_tokens

    def echo_fields(self) -> dict[str, Any]:
        return {}

    def to_job_request(self, settings: Settings) -> JobRequest:
        """The job to run, with this server's ``settings`` (its default max_tokens and limits);
        ApiError 400 for what Spool refuses, RequestValidationError for bad values."""
        _refuse_extras(self.model_extra)
        include_usage = continuous_usage = False
        if self.stream_options is not None:
            if not self.stream:
                raise ApiError(
                    400, "stream_options is only allowed with stream: true", param="stream_options"
                )
            _refuse_extras(self.stream_options.model_extra, "stream_options.")
            include_usage = bool(self.stream_options.include_usage)
            continuous_usage = bool(self.stream_options.continuous_usage_stats)
        tokens_name, max_tokens = self.max_tokens_field()
        if self.min_tokens is not None and self.min_tokens > (
            limit := max_tokens or settings.default_max_tokens
        ):
            # JobRequest checks it too, as a whole-body error: here it gets its param.
            raise ApiError(
                400,
                f"min_tokens is {self.min_tokens}; it must be at most {tokens_name} ({limit})",
                param="min_tokens",
                code="out_of_range",
            )
        fields: dict[str, Any] = {
            **self.prompt_fields(),
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop,
            "seed": self.seed,
            "user": self.user,
            "background": self.background,
            "stream_include_usage": include_usage,
            "stream_continuous_usage": continuous_usage,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
            "logit_bias": _logit_bias(self.logit_bias),
            "logprobs": self.logprobs_field(),
            "response_format": self._response_format(),
            "guided_regex": self.guided_regex,
            "guided_choice": self.guided_choice,
            "n": self.n,
            "webhook": self.webhook,
            "webhook_events": self.webhook_events,
            "service_tier": service_tier(self.service_tier),
            "priority": self.priority,
            "ignore_eos": self.ignore_eos,
            "prompt_logprobs": self.prompt_logprobs,
            **self.echo_fields(),
        }
        try:
            return JobRequest.accept({k: v for k, v in fields.items() if v is not None}, settings)
        except ValidationError as e:
            raise body_errors(e, {"max_tokens": tokens_name}) from None

    def _response_format(self) -> dict[str, Any] | None:
        if self.guided_json is None:
            return self.response_format
        if self.response_format is not None:
            raise ApiError(400, "give one of response_format or guided_json", param="guided_json")
        schema = self.guided_json
        if isinstance(schema, str):  # vLLM takes the schema as JSON text too
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise ApiError(400, f"guided_json is not JSON: {e}", param="guided_json") from None
            except RecursionError:
                raise ApiError(
                    400, too_deep_message("guided_json"), param="guided_json", code=TOO_DEEP
                ) from None
            if not isinstance(schema, dict):
                raise ApiError(400, "guided_json must be a JSON schema (an object)", param="guided_json")
        return {"type": "json_schema", "json_schema": {"name": "guided_json", "schema": schema}}


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    for key in bias:
        if not key.isdigit():
            raise ApiError(400, f"logit_bias keys must be token ids; got {key!r}", param="logit_bias")
    return {int(k): v for k, v in bias.items()}


def _at_most(name: str, value: int | None, limit: int) -> int | None:
    if value is not None and not 0 <= value <= limit:
        raise ApiError(
            400, f"{name} is {value}; it must be between 0 and {limit}", param=name, code="out_of_range"
        )
    return value


class CompletionRequest(OpenAIRequest):
    # A string, a list of strings, a token-id list or a list of them: each prompt its n choices.
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = None  # top logprobs per token, 0 to 5 (OpenAI's legacy completions)
    echo: bool | None = None  # the prompt first in each choice's text (and logprobs)

    def logprobs_field(self) -> int | None:
        return _at_most("logprobs", self.logprobs, COMPLETION_MAX_LOGPROBS)

    def echo_fields(self) -> dict[str, Any]:
        return {"echo": True} if self.echo else {}

    def prompt_fields(self) -> dict[str, Any]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return {"prompt": prompt}
        if not prompt:
            raise ApiError(400, "prompt is an empty list; give at least one prompt", param="prompt")
        if all(isinstance(t, int) for t in prompt):  # one prompt of token ids
            return {"prompts": [prompt]}
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return {"prompt": prompt[0]}
        return {"prompts": prompt}


class ChatCompletionRequest(OpenAIRequest):
    messages: list[Message]
    max_completion_tokens: StrictInt | None = None
    logprobs: bool | None = None
    top_logprobs: StrictInt | None = None  # 0 to 20, with logprobs: true
    tools: list[dict[str, Any]] | None = None  # validated as JobRequest's Tool
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def logprobs_field(self) -> int | None:
        top = _at_most("top_logprobs", self.top_logprobs, MAX_LOGPROBS)
        if not self.logprobs:
            if top is not None:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        return top or 0

    def max_tokens_field(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ApiError(
                    400,
                    "max_tokens and max_completion_tokens disagree; give one of them",
                    param="max_completion_tokens",
                )
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def prompt_fields(self) -> dict[str, Any]:
        return {
            "messages": [_message(m, i) for i, m in enumerate(self.messages)],
            **tool_fields(self.tools or None, self.tool_choice, self.parallel_tool_calls, chat=True),
        }


def tool_fields(
    tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None, parallel: bool | None, chat: bool
) -> dict[str, Any]:
    """JobRequest's tools, tool_choice and parallel_tool_calls; ``chat``: a named choice is
    chat's {"type": "function", "function": {"name": ...}}, else the Responses API's
    {"type": "function", "name": ...}."""
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if chat else choice.get("name")
        if choice.get("type") != "function" or not isinstance(name, str):
            shape = (
                '{"type": "function", "function": {"name": ...}}'
                if chat
                else '{"type": "function", "name": ...}'
            )
            raise ApiError(400, f"tool_choice must be auto, none, required or {shape}", param="tool_choice")
        choice = name
    if choice is not None and tools is None:
        raise ApiError(400, "tool_choice needs tools", param="tool_choice")
    fields = {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}
    return {k: v for k, v in fields.items() if v is not None}


def _message(m: Message, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if m.role not in _ROLES:
        raise ApiError(
            400,
            f"{where}.role {m.role!r} is not supported; use one of {', '.join(_ROLES)}",
            param=f"{where}.role",
            code="unsupported_parameter",
        )
    _refuse_extras(m.model_extra, f"{where}.")
    if m.name is not None:
        _refuse_extras({"name": m.name}, f"{where}.")
    if m.content is None and not (m.role == "assistant" and m.tool_calls):
        raise ApiError(400, f"{where}.content is required", param=f"{where}.content")
    message = {
        "role": _ROLES[m.role],
        "content": None if m.content is None else _text(m.content, where),
        "tool_calls": m.tool_calls,
        "tool_call_id": m.tool_call_id,
    }
    return {k: v for k, v in message.items() if v is not None}


def _text(content: str | list[TextPart], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise ApiError(
                400,
                f"{where}.content[{j}].type {part.type!r} is not supported; only text parts are",
                param=f"{where}.content[{j}].type",
                code="unsupported_parameter",
            )
        _refuse_extras(part.model_extra, f"{where}.content[{j}].")
        texts.append(part.text)
    return "".join(texts)
