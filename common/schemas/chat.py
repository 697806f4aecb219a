"""The OpenAI-shaped pieces of a text request: chat messages and their tool calls, function tools,
and ``response_format``."""

from __future__ import annotations

import json
from typing import Any, Literal, Self

import jsonschema
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from common.schemas.checks import INVALID_SCHEMA, encodable, guide_size, stored


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
        return encodable(v)

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
        if stored(info):  # checked when it was accepted
            return v
        guide_size(
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
