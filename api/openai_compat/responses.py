"""OpenAI's Responses API on the job queue: the request, the stored response, and its events.

A response is a chat job (its ``id`` is ``resp_`` + the job's id) with a record of its own on the
job's hash (common/store/responses.py): the input items, instructions, metadata and the rest of
what the response object shows, and the conversation so far for ``previous_response_id``.

A stream's ``sequence_number`` comes from the job's log, so every replica numbers the events of
a response alike and ``starting_after=N`` resumes anywhere: the response's opening events take
0 .. H-1 (H is 4, or 5 with ``response.queued`` in background mode), the log entry with seq k
starts at H + k - 1 (a token entry is one ``response.output_text.delta``), and the terminal entry
closes the message and ends with the response's terminal event.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fastapi.sse import ServerSentEvent
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.errors import ApiError, body_errors
from api.openai_compat.requests import _Open, _refuse_extras, tool_fields
from common.schemas.events import LogEntry
from common.schemas.requests import JobRequest
from common.schemas.views import Job, JobError, JobStatus, Usage
from common.settings import Settings
from common.store.responses import RESPONSE_PREFIX
from common.tool_calls import Call, call_id, parse

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")  # content parts an input message may hold
MAX_METADATA = 16  # OpenAI's limits on metadata: pairs, key and value lengths
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512


def response_id(job_id: str) -> str:
    return RESPONSE_PREFIX + job_id


def job_id_of(resp_id: str) -> str | None:
    """The job behind a response id; None for an id that is no response's."""
    job_id = resp_id.removeprefix(RESPONSE_PREFIX)
    ok = resp_id.startswith(RESPONSE_PREFIX) and 0 < len(job_id) <= 64
    return job_id if ok and all(c.isalnum() or c in "_-" for c in job_id) else None


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
            return [_message_item("user", self.input)]
        if not self.input:
            raise ApiError(400, "input is empty; give a string or at least one item", param="input")
        return [_input_item(item, f"input[{i}]") for i, item in enumerate(self.input)]

    def check(self) -> None:
        """Refuse what Spool does not implement, by name."""
        _refuse_extras(self.model_extra)
        if self.truncation not in (None, "disabled"):
            raise ApiError(
                400, "truncation 'auto' is not supported", param="truncation", code="unsupported_parameter"
            )
        if self.stream and self.tools and self.tool_choice != "none":
            raise ApiError(
                400,
                "stream with tools is not supported yet on /v1/responses; use background mode and poll",
                param="stream",
                code="unsupported_parameter",
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


def _message_item(role: str, text: str) -> dict[str, Any]:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


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
    if role not in _ROLES:
        raise ApiError(
            400, f"{where}.role must be one of {', '.join(_ROLES)}; got {role!r}", param=f"{where}.role"
        )
    _refuse_extras(
        {k: v for k, v in item.items() if k not in ("type", "role", "content", "id", "status")}, f"{where}."
    )
    if isinstance(content, str):
        return _message_item(role, content)
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
    return _message_item(role, "".join(texts))


def item_text(item: dict[str, Any]) -> str:
    return "".join(part["text"] for part in item["content"])


class ResponseRecord(BaseModel):
    """What a response keeps besides its job (stored as JSON on the job's hash)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    created_at: float = 0.0  # its job's creation, unix seconds
    input: list[dict[str, Any]]  # this request's input items
    # The conversation before this input (from previous_response_id), as message items.
    history: list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text_format: dict[str, Any] | None = None  # the request's text.format; None: plain text
    user: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)  # as the request gave them
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    tool_parser: str | None = None  # how the served model's calls are read (common/tool_calls.py)

    def messages(self) -> list[dict[str, Any]]:
        """The chat the job renders: instructions, the earlier turns, this input (a run of
        function_call items is one assistant message with tool_calls; an output, a tool message)."""
        turns: list[dict[str, Any]] = (
            [{"role": "system", "content": self.instructions}] if self.instructions else []
        )
        for i in (*self.history, *self.input):
            kind = i.get("type", "message")
            if kind == "function_call":
                call = {
                    "id": i["call_id"],
                    "type": "function",
                    "function": {"name": i["name"], "arguments": i["arguments"]},
                }
                if turns and turns[-1]["role"] == "assistant" and "tool_calls" in turns[-1]:
                    turns[-1]["tool_calls"].append(call)
                else:
                    turns.append({"role": "assistant", "tool_calls": [call]})
            elif kind == "function_call_output":
                turns.append({"role": "tool", "tool_call_id": i["call_id"], "content": i["output"]})
            else:
                turns.append({"role": _ROLES[i["role"]], "content": item_text(i)})
        return turns


@dataclass(frozen=True)
class ResponseView:
    """One response in OpenAI's shapes: the object, and the stream events of its job's log."""

    job_id: str
    record: ResponseRecord

    @classmethod
    def of_line(cls, job: Job, request: JobRequest, model: str) -> ResponseView:
        """A batch line's response: its record rebuilt from its job (the line's instructions
        are its first message, and its metadata is not kept)."""
        fmt = request.response_format
        record = ResponseRecord(
            model=model,
            created_at=job.created_at,
            input=[_message_item(m.role, m.content or "") for m in request.messages or ()],
            max_output_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            text_format=fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else None,
            user=request.user,
        )
        return cls(job.id, record)

    @property
    def id(self) -> str:
        return response_id(self.job_id)

    @property
    def message_id(self) -> str:
        return f"msg_{self.job_id}"

    @property
    def opening(self) -> int:
        """How many events open the stream, before the log's (H in the module's doc)."""
        return 5 if self.record.background else 4

    # -- the object -------------------------------------------------------------------------------

    def obj(self, job: Job | None, status: str | None = None) -> dict[str, Any]:
        """The response object, from its job (None: as it opens, ``status`` given)."""
        r = self.record
        output: list[dict[str, Any]] = []
        error = incomplete = usage = None
        if job is not None:
            status, error, incomplete = _status(job)
            output = self._output(job, status)
            usage = _usage(job.usage)
        return {
            "id": self.id,
            "object": "response",
            "created_at": int(r.created_at),
            "status": status,
            "background": r.background,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "metadata": r.metadata,
            "model": r.model,
            "output": output,
            "parallel_tool_calls": r.parallel_tool_calls,
            "previous_response_id": r.previous_response_id,
            "store": r.store,
            "temperature": r.temperature if r.temperature is not None else 1.0,
            "text": {"format": r.text_format or {"type": "text"}},
            "tool_choice": r.tool_choice,
            "tools": r.tools,
            "top_p": r.top_p if r.top_p is not None else 1.0,
            "truncation": "disabled",
            "usage": usage,
            "user": r.user,
        }

    def _output(self, job: Job, status: str) -> list[dict[str, Any]]:
        """The output items: the message (when there is text, or the response ended), then the
        function calls read from the text."""
        r, text = self.record, job.text
        calls: list[Call] = []
        if r.tool_parser is not None and r.tools and r.tool_choice != "none" and status != "in_progress":
            text, calls = parse(r.tool_parser, text)
            calls = calls[:1] if not r.parallel_tool_calls else calls
        done = "completed" if status == "completed" else "incomplete"
        output = (
            [self._message(text, done)]
            if text or (status in ("completed", "incomplete") and not calls)
            else []
        )
        return output + [
            {
                "id": f"fc_{self.job_id}_{k}",
                "type": "function_call",
                "status": "completed",
                "call_id": call_id(self.job_id, k),
                "name": c.name,
                "arguments": c.arguments,
            }
            for k, c in enumerate(calls)
        ]

    def _message(self, text: str, status: str) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [_output_text(text)] if status != "in_progress" else [],
        }

    # -- the stream -------------------------------------------------------------------------------

    def opening_events(self, after: int) -> list[ServerSentEvent]:
        """The events before the log's, those with sequence_number > ``after``."""
        first = "queued" if self.record.background else "in_progress"
        bodies: list[dict[str, Any]] = [{"type": "response.created", "response": self.obj(None, first)}]
        if self.record.background:
            bodies.append({"type": "response.queued", "response": self.obj(None, "queued")})
        bodies += [
            {"type": "response.in_progress", "response": self.obj(None, "in_progress")},
            {
                "type": "response.output_item.added",
                "output_index": 0,
                "item": self._message("", "in_progress"),
            },
            {
                "type": "response.content_part.added",
                "item_id": self.message_id,
                "output_index": 0,
                "content_index": 0,
                "part": _output_text(""),
            },
        ]
        return [_event(n, body) for n, body in enumerate(bodies) if n > after]

    def cursor(self, after: int, log_length: int) -> int:
        """The log seq to relay after, for the events after sequence number ``after`` (the log
        holding ``log_length`` entries): the entry of event ``after`` + 1, or the last one, whose
        events may run past its first number (the terminal entry's)."""
        return max(0, min(after - self.opening + 1, log_length - 1))

    def entry_events(self, entry: LogEntry, job: Job | None, after: int) -> list[ServerSentEvent]:
        """The events of one log entry (a terminal one needs its ``job``: the text, the usage)."""
        n = self.opening + entry.seq - 1
        if entry.type == "token":
            bodies: list[dict[str, Any]] = [
                {
                    **self._where(),
                    "type": "response.output_text.delta",
                    "delta": entry.data["text"],
                    "logprobs": [],
                }
            ]
        elif entry.type in ("done", "error"):
            assert job is not None
            bodies = self._closing(job)
        else:  # (a response's job has no parts: no other entries)
            bodies = []
        return [_event(n + k, body) for k, body in enumerate(bodies) if n + k > after]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    def _closing(self, job: Job) -> list[dict[str, Any]]:
        final = self.obj(job)
        kind = {"completed": "completed", "incomplete": "incomplete", "cancelled": "cancelled"}
        if final["status"] == "failed":
            return [{"type": "response.failed", "response": final}]
        item_status = "completed" if final["status"] == "completed" else "incomplete"
        return [
            {**self._where(), "type": "response.output_text.done", "text": job.text, "logprobs": []},
            {**self._where(), "type": "response.content_part.done", "part": _output_text(job.text)},
            {
                "type": "response.output_item.done",
                "output_index": 0,
                "item": self._message(job.text, item_status),
            },
            {"type": f"response.{kind[final['status']]}", "response": final},
        ]


def _status(job: Job) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """(status, error, incomplete_details) of the response a job is."""
    if job.status is JobStatus.QUEUED:
        return "queued", None, None
    if job.status is JobStatus.RUNNING:
        return "in_progress", None, None
    if job.status is JobStatus.FAILED:
        err = job.error or JobError(message="the job failed", type="engine_error")
        return "failed", {"code": err.type, "message": err.message}, None
    if job.status is JobStatus.CANCELLED:
        return "cancelled", None, None
    if job.finish_reason == "length":
        return "incomplete", None, {"reason": "max_output_tokens"}
    return "completed", None, None


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _event(n: int, body: dict[str, Any]) -> ServerSentEvent:
    body = {**body, "sequence_number": n}
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    # NOTE: no SSE id: the openai client keeps the last id and makes an event of every later
    # keep-alive comment (empty data, which it fails to parse as JSON). starting_after resumes.
    return ServerSentEvent(event=body["type"], raw_data=data)
