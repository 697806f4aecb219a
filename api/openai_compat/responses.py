"""OpenAI's Responses API on the job queue: a response's object and its stream's events.

The request is response_request.py's, and what a response keeps besides its job is
response_record.py's. A stream's ``sequence_number`` comes from the job's log, so every replica
numbers the events of a response alike and ``starting_after=N`` resumes anywhere. Without tools
the numbers are a formula of the log's seq. With tools the text is read for calls as it comes
(response_output.py), so an entry gives no, one or several events, and every stream counts them
from the log's first entry. The numbering:
docs/internals.md#responses-apiroutesresponsespy-apiopenai_compatresponsespy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from api.openai_compat.response_output import ToolOutput, output_text
from api.openai_compat.response_record import ResponseRecord, message_item, response_id
from common.schemas.events import LogEntry
from common.schemas.requests import JobRequest
from common.schemas.views import Job, JobError, JobStatus, Usage


@dataclass(frozen=True)
class ResponseView:
    """One response in OpenAI's shapes: the object, and the stream events of its job's log."""

    job_id: str
    record: ResponseRecord

    @classmethod
    def of_line(cls, job: Job, request: JobRequest, model: str, tool_parser: str | None) -> ResponseView:
        """A batch line's response: its record rebuilt from its job (the line's instructions
        are its first message, and its metadata is not kept)."""
        fmt = request.response_format
        tools = [
            {"type": "function", **t.function.model_dump(exclude_none=True)} for t in request.tools or ()
        ]
        choice = request.tool_choice
        record = ResponseRecord(
            model=model,
            created_at=job.created_at,
            input=[message_item(m.role, m.content or "") for m in request.messages or ()],
            max_output_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            text_format=fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else None,
            user=request.user,
            tools=tools,
            tool_choice=choice
            if choice in ("auto", "none", "required")
            else {"type": "function", "name": choice},
            parallel_tool_calls=request.parallel_tool_calls,
            tool_parser=tool_parser,
        )
        return cls(job.id, record)

    @property
    def id(self) -> str:
        return response_id(self.job_id)

    @property
    def message_id(self) -> str:
        return f"msg_{self.job_id}"

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

    @property
    def tools_on(self) -> bool:
        """Calls are read from the text (response_output.py)."""
        r = self.record
        return r.tool_parser is not None and bool(r.tools) and r.tool_choice != "none"

    def tool_output(self) -> ToolOutput:
        assert self.record.tool_parser is not None
        return ToolOutput(self.job_id, self.record.tool_parser, not self.record.parallel_tool_calls)

    def _output(self, job: Job, status: str) -> list[dict[str, Any]]:
        """The output items: with tools, the messages and calls read from the text; without, the
        message (when there is text, or the response ended)."""
        if self.tools_on:
            ended = None if status in ("queued", "in_progress") else _item_status(status)
            return self.tool_output().whole(job.text, ended)
        if job.text or status in ("completed", "incomplete"):
            return [self._message(job.text, _item_status(status))]
        return []

    def _message(self, text: str, status: str) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [output_text(text)] if status != "in_progress" else [],
        }

    # -- the stream -------------------------------------------------------------------------------

    @property
    def opening(self) -> int:
        """How many events open the stream, before the log's (H in the module's doc)."""
        return (3 if self.record.background else 2) + (0 if self.tools_on else 2)

    def opening_events(self, after: int) -> list[bytes]:
        """The events before the log's, those with sequence_number > ``after``."""
        first = "queued" if self.record.background else "in_progress"
        bodies: list[dict[str, Any]] = [{"type": "response.created", "response": self.obj(None, first)}]
        if self.record.background:
            bodies.append({"type": "response.queued", "response": self.obj(None, "queued")})
        bodies.append({"type": "response.in_progress", "response": self.obj(None, "in_progress")})
        if not self.tools_on:  # with tools a message opens at its first text (response_output.py)
            bodies += [
                {
                    "type": "response.output_item.added",
                    "output_index": 0,
                    "item": self._message("", "in_progress"),
                },
                {**self._where(), "type": "response.content_part.added", "part": output_text("")},
            ]
        return [_event(n, body) for n, body in enumerate(bodies) if n > after]

    def cursor(self, after: int, log_length: int) -> int:
        """The log seq to relay after, for the events after sequence number ``after`` (the log
        holding ``log_length`` entries): the entry of event ``after`` + 1, or the last one, whose
        events may run past its first number (the terminal entry's). With tools: the start."""
        if self.tools_on:
            return 0
        return max(0, min(after - self.opening + 1, log_length - 1))

    def last_event_at_most(self, log_length: int) -> int:
        """A bound on the last event's sequence number, the log holding ``log_length`` entries."""
        if self.tools_on:  # an entry's text may close a message and hold calls
            return self.opening + 16 * (log_length + 1)
        return self.opening + log_length + 2  # a terminal entry is up to 4 events

    def events(self, after: int) -> ResponseEvents:
        """The state of one stream, which turns the log's entries into events."""
        return ResponseEvents(self, after, self.tool_output() if self.tools_on else None)

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    def closing(self, job: Job, output: ToolOutput | None) -> list[dict[str, Any]]:
        """The events of the terminal entry: the open items closed, the response's end."""
        final = self.obj(job)
        if final["status"] == "failed":
            return [{"type": "response.failed", "response": final}]
        status = _item_status(final["status"])
        if output is not None:
            bodies = output.end(status)
        else:
            bodies = [
                {**self._where(), "type": "response.output_text.done", "text": job.text, "logprobs": []},
                {**self._where(), "type": "response.content_part.done", "part": output_text(job.text)},
                {
                    "type": "response.output_item.done",
                    "output_index": 0,
                    "item": self._message(job.text, status),
                },
            ]
        return [*bodies, {"type": f"response.{final['status']}", "response": final}]


class ResponseEvents:
    """One stream's events, entry by entry (each entry once, in order, as the relay gives them)."""

    def __init__(self, view: ResponseView, after: int, output: ToolOutput | None) -> None:
        self._view = view
        self._after = after  # the events up to this sequence number are not sent
        self._output = output  # with tools: the output so far (the stream reads the log from seq 1)
        self._next = view.opening  # with tools: the number of the next event

    def of(self, entry: LogEntry, job: Job | None) -> list[bytes]:
        """The events of one log entry (a terminal one needs its ``job``: the text, the usage)."""
        if self._output is None:
            self._next = self._view.opening + entry.seq - 1
        if entry.type == "token":
            if self._output is not None:
                bodies = self._output.feed(entry.data["text"])
            else:
                delta = {"type": "response.output_text.delta", "delta": entry.data["text"], "logprobs": []}
                bodies = [{**self._view._where(), **delta}]
        elif entry.type in ("done", "error"):
            assert job is not None
            bodies = self._view.closing(job, self._output)
        else:  # (a response's job has no parts: no other entries)
            bodies = []
        n, self._next = self._next, self._next + len(bodies)
        return [_event(n + k, body) for k, body in enumerate(bodies) if n + k > self._after]


def _item_status(status: str) -> str:
    """A finished output item's status in a response of ``status``."""
    return "completed" if status == "completed" else "incomplete"


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


def _event(n: int, body: dict[str, Any]) -> bytes:
    """One event in the SSE wire format, as ``api.sse.encode`` writes a ServerSentEvent with
    ``event`` and ``raw_data``.

    NOTE: formatted here (as ``api.sse.job_event`` is), not through a ServerSentEvent, a pydantic
    model. No SSE id: the openai client keeps the last id and makes an event of every later
    keep-alive comment (empty data, which it fails to parse as JSON); starting_after resumes.
    One ``data:`` line is enough: ``json.dumps`` escapes every newline."""
    body = {**body, "sequence_number": n}
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return b"event: %s\ndata: %s\n\n" % (body["type"].encode(), data.encode())
