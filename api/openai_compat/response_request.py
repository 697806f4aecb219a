"""The body of ``POST /v1/responses`` (and of a batch's ``/v1/responses`` line), checked."""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, ValidationError

from api.errors import ApiError, body_errors
from api.openai_compat.requests import _Open, _refuse_extras, service_tier, tool_fields
from api.openai_compat.response_record import ROLES, ResponseRecord, message_item
from common.schemas.requests import JobRequest
from common.settings import Settings

_TEXT_PARTS = ("input_text", "output_text", "text")  # content parts an input message may hold
MAX_METADATA = 16  # OpenAI's limits on metadata: pairs, key and value lengths
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512


class TextFormat(_Open):
    type: str
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Open):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponseRequest(_Open):
    """The body of ``POST /v1/responses``. ``seed`` is Spool's (OpenAI's Responses has none)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = None
    truncation: str | None = None
    # Spool's: where to POST the response's end (response.completed, ...: docs/webhooks.md).
    webhook: str | None = None
    webhook_events: list[str] | None = None
    tools: list[dict[str, Any]] | None = None  # function tools, {"type": "function", "name", ...}
    tool_choice: str | dict[str, Any] | None = None
    service_tier: str | None = None  # as chat's: auto and default (interactive), flex (the batch tier)
    prompt_cache_key: str | None = None  # as chat's: any key is served and changes nothing
    # OpenAI's only stream option here is include_obfuscation; false (or absent) asks for nothing.
    stream_options: dict[str, Any] | None = None

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The tools in chat's shape ({"type": "function", "function": {...}})."""
        if not self.tools:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise ApiError(
                    400,
                    f"tools[{i}].type {tool.get('type')!r} is not supported; only function tools are "
                    "(no built-in tools such as web search)",
                    param=f"tools[{i}].type",
                    code="unsupported_parameter",
                )
            out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
        return out

    def input_items(self) -> list[dict[str, Any]]:
        """The input as message items, each checked (400 naming the item)."""
        if isinstance(self.input, str):
            return [message_item("user", self.input)]
        if not self.input:
            raise ApiError(400, "input is empty; give a string or at least one item", param="input")
        return [_input_item(item, f"input[{i}]") for i, item in enumerate(self.input)]

    def check(self) -> None:
        """Refuse what Spool does not implement, by name."""
        _refuse_extras(self.model_extra)
        _refuse_extras(self.stream_options, "stream_options.")
        service_tier(self.service_tier)
        if self.truncation not in (None, "disabled"):
            raise ApiError(
                400, "truncation 'auto' is not supported", param="truncation", code="unsupported_parameter"
            )
        if self.background and not self.store:
            raise ApiError(400, "background mode needs store: true", param="store")
        if self.text is not None:
            _refuse_extras(self.text.model_extra, "text.")
        if self.metadata is not None and (
            len(self.metadata) > MAX_METADATA
            or any(len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in self.metadata.items())
        ):
            raise ApiError(
                400,
                f"metadata holds at most {MAX_METADATA} pairs, keys of at most {MAX_METADATA_KEY} "
                f"characters and values of at most {MAX_METADATA_VALUE}",
                param="metadata",
            )

    def response_format(self) -> dict[str, Any] | None:
        """``text.format`` as chat's ``response_format``."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None:
            return None
        _refuse_extras(fmt.model_extra, "text.format.")
        if fmt.type != "json_schema":
            return {"type": fmt.type}
        if fmt.schema_ is None:
            raise ApiError(400, "text.format.schema is required with type json_schema", param="text.format")
        spec = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
        if fmt.description is not None:
            spec["description"] = fmt.description
        return {"type": "json_schema", "json_schema": spec}

    def record(self, model: str, history: list[dict[str, Any]]) -> ResponseRecord:
        """What the response keeps besides its job, ``history`` the conversation it continues."""
        fmt = self.text.format if self.text is not None else None
        return ResponseRecord(
            model=model,
            input=self.input_items(),
            history=history,
            instructions=self.instructions,
            previous_response_id=self.previous_response_id,
            store=self.store,
            background=self.background,
            metadata=self.metadata or {},
            max_output_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            text_format=fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else None,
            user=self.user,
            tools=self.tools or [],
            tool_choice=self.tool_choice or "auto",
            parallel_tool_calls=self.parallel_tool_calls is not False,
        )

    def batch_job_request(self, settings: Settings) -> JobRequest:
        """The job of a batch line: one that continues no earlier response (a batch's lines are
        checked with no API key's responses at hand)."""
        self.check()
        if self.previous_response_id is not None:
            raise ApiError(
                400,
                "previous_response_id is not supported in a batch",
                param="previous_response_id",
                code="unsupported_parameter",
            )
        return self.to_job_request(settings, self.record("", []).messages())

    def to_job_request(self, settings: Settings, messages: list[dict[str, Any]]) -> JobRequest:
        fields: dict[str, Any] = {
            "messages": messages,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "user": self.user,
            "background": self.background,
            "response_format": self.response_format(),
            **tool_fields(self.chat_tools(), self.tool_choice, self.parallel_tool_calls, chat=False),
            "webhook": self.webhook,
            "webhook_events": self.webhook_events,
            "service_tier": self.service_tier,
        }
        if self.webhook_events is not None and self.webhook_events != ["completed"]:
            raise ApiError(
                400,
                "a response's webhook_events is ['completed'] (its end: response.completed, "
                "response.failed, response.cancelled or response.incomplete)",
                param="webhook_events",
                code="invalid_webhook",
            )
        try:
            request = JobRequest.accept({k: v for k, v in fields.items() if v is not None}, settings)
        except ValidationError as e:
            raise body_errors(e, {"max_tokens": "max_output_tokens", "response_format": "text"}) from None
        return request.as_response()


# The fields of a function call item and of its output's, all strings.
_CALL_ITEMS = {
    "function_call": ("call_id", "name", "arguments"),
    "function_call_output": ("call_id", "output"),
}


def _input_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    kind = item.get("type", "message")
    if kind in _CALL_ITEMS:
        fields = _CALL_ITEMS[kind]
        _refuse_extras(
            {k: v for k, v in item.items() if k not in ("type", "id", "status", *fields)}, f"{where}."
        )
        for name in fields:
            if not isinstance(item.get(name), str):
                raise ApiError(400, f"{where}.{name} must be a string", param=f"{where}.{name}")
        if kind == "function_call":
            try:
                ok = isinstance(json.loads(item["arguments"]), dict)
            except ValueError:
                ok = False
            if not ok:
                raise ApiError(
                    400, f"{where}.arguments must be a JSON object, as text", param=f"{where}.arguments"
                )
        return {"type": kind, **{name: item[name] for name in fields}}
    if kind != "message":
        raise ApiError(
            400,
            f"{where}.type {kind!r} is not supported; input items are messages, function_call and "
            "function_call_output",
            param=f"{where}.type",
            code="unsupported_parameter",
        )
    role, content = item.get("role"), item.get("content")
    if role not in ROLES:
        raise ApiError(
            400, f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}", param=f"{where}.role"
        )
    _refuse_extras(
        {k: v for k, v in item.items() if k not in ("type", "role", "content", "id", "status")}, f"{where}."
    )
    if isinstance(content, str):
        return message_item(role, content)
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of parts", param=f"{where}.content")
    texts = []
    for j, part in enumerate(content):
        if (
            not isinstance(part, dict)
            or part.get("type") not in _TEXT_PARTS
            or not isinstance(part.get("text"), str)
        ):
            got = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ApiError(
                400,
                f"{where}.content[{j}].type {got!r} is not supported; only text parts are",
                param=f"{where}.content[{j}].type",
                code="unsupported_parameter",
            )
        texts.append(part["text"])
    return message_item(role, "".join(texts))
