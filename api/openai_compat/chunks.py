"""A job in the OpenAI shapes: the completion objects, and stream chunks from its log entries.

Each log entry becomes its own chunks with the entry's seq as the SSE id, so a stream resumed
after id n (``Last-Event-ID``) gets exactly the chunks that followed n: the first token entry
carries the assistant role, the terminal entry gives the finish chunk, the usage chunk when the
request asked for it (``stream_options.include_usage``) and ``data: [DONE]``.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi.sse import ServerSentEvent

from api.errors import ApiError, error_body
from common.schemas.events import LogEntry, TokenLogprob, TopLogprob
from common.schemas.requests import JobRequest
from common.schemas.views import Job, JobError, Usage
from common.tool_calls import PARSERS, Call, CallStream, call_id, parse

DONE = ServerSentEvent(raw_data="[DONE]")

# How a failed job answers: (HTTP status, code). The job's error type is the key.
_FAILURES: dict[str, tuple[int, str]] = {
    "request_too_long": (400, "context_length_exceeded"),
    "invalid_request": (400, "invalid_request"),
    # The guide's grammar took too long to mask the vocabulary, step after step (the worker's
    # SPOOL_MAX_GUIDE_MASK_MS): the request's fault, and sending it again fails again.
    "guide_too_expensive": (400, "guide_too_expensive"),
    "timeout": (504, "timeout"),
}
_ABOUT_THE_PROMPT = ("request_too_long", "invalid_request")  # the 400s whose param is the prompt's


def failure(error: JobError, param: str | None = None) -> ApiError:
    status, code = _FAILURES.get(error.type, (500, error.type))
    return ApiError(
        status, error.message, param=param if error.type in _ABOUT_THE_PROMPT else None, code=code
    )


@dataclass
class UsageSoFar:
    """A stream's usage as its chunks go (vLLM's ``stream_options.continuous_usage_stats``): the
    prompt's tokens as the API counted them, the tokens of the entries rendered so far, and the
    job's own figures from its terminal entry on."""

    prompt_tokens: int
    completion_tokens: int = 0

    def count(self, entry: LogEntry) -> None:
        if entry.type == "token":
            self.completion_tokens += len(entry.data.get("token_ids", ()))
        elif entry.type == "done":
            usage = Usage.model_validate(entry.data["usage"])
            self.prompt_tokens, self.completion_tokens = usage.prompt_tokens, usage.completion_tokens

    def usage(self) -> dict[str, Any]:
        return Usage.of(self.prompt_tokens, self.completion_tokens).model_dump()


@dataclass(frozen=True)
class View:
    """How one job looks in the OpenAI format."""

    chat: bool  # chat.completion(.chunk) for messages, text_completion for a prompt
    id: str  # chatcmpl-<job id> | cmpl-<job id>
    created: int  # the job's creation, unix seconds
    model: str  # the served model's name
    include_usage: bool  # the stream ends with a usage chunk
    logprobs: bool  # the request asked for logprobs: choices carry them
    n: int = 1  # choices: a job with n > 1 says in its token events which one each belongs to
    job_id: str = ""
    # echo: each choice's text and logprobs start with its prompt's (prompt k // per_prompt):
    # a string prompt's own text, a token-id prompt's (None here) its tokens' texts joined.
    echo: bool = False
    prompts: tuple[str | None, ...] = ()
    per_prompt: int = 1  # the request's n: choices per prompt
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs: each choice (chat: the response) has them
    tool_parser: str | None = None  # calls are read from the text (common/tool_calls.py); None: none
    single_call: bool = False  # parallel_tool_calls false: the first call only
    running_usage: UsageSoFar | None = None  # every chunk carries the usage so far; None: the last only

    @classmethod
    def of(
        cls,
        job_id: str,
        created_at: float,
        request: JobRequest,
        model: str,
        tool_parser: str | None = None,
        prompt_tokens: int | None = None,
    ) -> View:
        """``prompt_tokens``: the prompt's count, for a stream with continuous usage (0 unknown)."""
        chat = request.messages is not None
        return cls(
            chat=chat,
            id=f"{'chatcmpl' if chat else 'cmpl'}-{job_id}",
            created=int(created_at),
            model=model,
            include_usage=request.stream_include_usage,
            logprobs=request.logprobs is not None,
            n=request.num_choices,
            job_id=job_id,
            echo=request.echo,
            prompts=tuple(p if isinstance(p, str) else None for p in request.prompt_list),
            per_prompt=request.n,
            prompt_logprobs=request.prompt_logprobs is not None,
            tool_parser=tool_parser if request.tools_on else None,
            single_call=not request.parallel_tool_calls,
            running_usage=UsageSoFar(prompt_tokens or 0) if request.stream_continuous_usage else None,
        )

    def tool_stream(self) -> ToolStream | None:
        """The state a stream with tools keeps from chunk to chunk; None without tools."""
        if self.tool_parser is None:
            return None
        return ToolStream(CallStream(PARSERS[self.tool_parser]), self)

    @property
    def needs_log(self) -> bool:
        """The completion body is built from the job's log (logprobs, or n > 1's choices)."""
        return self.logprobs or self.n > 1 or self.echo or self.prompt_logprobs

    @property
    def prompt_param(self) -> str:
        return "messages" if self.chat else "prompt"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- non-streamed -----------------------------------------------------------------------------

    def completion(self, job: Job, log: Sequence[LogEntry] = ()) -> dict[str, Any]:
        """The response body of a finished job (``log``: its entries, for the logprobs); raises
        the job's failure as an ApiError."""
        if job.error is not None:
            raise failure(job.error, self.prompt_param)
        if self.n == 1 and not self.echo and not self.prompt_logprobs:
            choices = [self._choice(0, job.text, log, job.finish_reason)]
        else:
            tokens = [e for e in log if e.type == "token"]
            choices = []
            for k in range(self.n):
                mine = [e for e in tokens if (e.data.get("choice") or 0) == k]
                reasons = [r for e in mine if (r := e.data.get("finish_reason"))]
                text = self._echoed(k, mine) + "".join(e.data["text"] for e in mine)
                choices.append(self._choice(k, text, mine, reasons[-1] if reasons else job.finish_reason))
        body = {
            **self._head("chat.completion" if self.chat else "text_completion"),
            "system_fingerprint": None,
            "choices": choices,
            "usage": job.usage.model_dump(),
        }
        if self.chat and self.prompt_logprobs:  # vLLM's place for chat: the response's (one prompt)
            body["prompt_logprobs"] = _vllm_prompt_logprobs(log)
        return body

    def _echoed(self, choice: int, entries: Sequence[LogEntry]) -> str:
        """With echo, the text of the choice's prompt (else nothing)."""
        if not self.echo:
            return ""
        if (text := self.prompts[choice // self.per_prompt]) is not None:
            return text
        return "".join(t for e in entries for t in e.data.get("prompt_tokens") or ())

    def calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The message's content and tool calls (OpenAI's shape) from the generated text."""
        if self.tool_parser is None:
            return text, []
        content, calls = parse(self.tool_parser, text)
        calls = calls[:1] if self.single_call else calls
        return content or None, [self.call_json(i, c) for i, c in enumerate(calls)]

    def call_json(self, index: int, call: Call) -> dict[str, Any]:
        return {
            "id": call_id(self.job_id, index),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }

    def _choice(
        self, index: int, text: str, log: Sequence[LogEntry], finish_reason: str | None
    ) -> dict[str, Any]:
        if self.chat:
            content, calls = self.calls(text)
            message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
            if calls:
                message["tool_calls"] = calls
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
            body: dict[str, Any] = {"message": message}
        else:
            body = {"text": text}
            if self.prompt_logprobs:  # vLLM's place for completions: each choice's
                body["prompt_logprobs"] = _vllm_prompt_logprobs(log)
        return {"index": index, **body, "logprobs": self._logprobs(log), "finish_reason": finish_reason}

    # -- streamed ---------------------------------------------------------------------------------

    def render(self, entry: LogEntry) -> list[ServerSentEvent]:
        """The stream chunks of one log entry (``api.sse.relay``'s ``render``)."""
        sid = str(entry.seq)
        if self.running_usage is not None:
            self.running_usage.count(entry)
        if entry.type == "token":
            # The first token entry opens the assistant's turn, as OpenAI's first chunk does
            # (with n > 1 every choice's: a stream resumed later has them all from seq 1 on).
            first = entry.data["index"] == 0
            choice = entry.data.get("choice") or 0
            opening = [self._chunk(sid, "", None, True, choice=k) for k in range(self.n) if k != choice]
            # With echo, a choice's first event (the one with its prompt's tokens) leads with its prompt.
            echoed = self._echoed(choice, [entry]) if "prompt_tokens" in entry.data else ""
            chunk = self._chunk(
                sid,
                echoed + entry.data["text"],
                entry.data.get("finish_reason"),  # n > 1: the choice's last event says why it ended
                first=first,
                logprobs=[entry],
                choice=choice,
            )
            return [*(opening if first and self.chat else []), chunk]
        if entry.type == "error":
            err = failure(JobError.model_validate(entry.data), self.prompt_param)
            return [_event(sid, error_body(err.status, err.message, err.param, err.code)), DONE]
        # done: a job that ended before any token (seq 1) still opens the turn. With n > 1 each
        # choice's finish came with its last token event, unless the job had none.
        if self.n == 1 or entry.seq == 1:
            reason = entry.data["finish_reason"]
            events = [self._chunk(sid, "", reason, first=entry.seq == 1, choice=k) for k in range(self.n)]
        else:
            events = []
        if self.include_usage:
            usage = Usage.model_validate(entry.data["usage"]).model_dump()
            events.append(_event(sid, {**self._chunk_head(), "choices": [], "usage": usage}))
        return [*events, DONE]

    def _chunk_head(self) -> dict[str, Any]:
        return {
            **self._head("chat.completion.chunk" if self.chat else "text_completion"),
            "system_fingerprint": None,
        }

    def _chunk(
        self,
        sid: str,
        text: str,
        finish_reason: str | None,
        first: bool,
        logprobs: Sequence[LogEntry] = (),
        choice: int = 0,
    ) -> ServerSentEvent:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text or finish_reason is None:
                delta["content"] = text
            part: dict[str, Any] = {"delta": delta}
        else:
            part = {"text": text}
        return self.part_chunk(sid, part, finish_reason, logprobs, choice)

    def part_chunk(
        self,
        sid: str,
        part: dict[str, Any],
        finish_reason: str | None,
        logprobs: Sequence[LogEntry] = (),
        choice: int = 0,
    ) -> ServerSentEvent:
        body = {
            **self._chunk_head(),
            "choices": [
                {
                    "index": choice,
                    **part,
                    "logprobs": self._logprobs(logprobs),
                    "finish_reason": finish_reason,
                }
            ],
        }
        if self.running_usage is not None:
            body["usage"] = self.running_usage.usage()
        elif self.include_usage:
            body["usage"] = None  # only the last chunk carries it
        return _event(sid, body)

    def _logprobs(self, entries: Sequence[LogEntry]) -> dict[str, Any] | None:
        """OpenAI's logprobs object for the tokens of ``entries`` (None unless asked for)."""
        if not self.logprobs:
            return None
        tokens = [
            TokenLogprob.model_validate(t)
            for e in entries
            if e.type == "token"
            for t in e.data.get("logprobs", ())
        ]
        if self.chat:
            return {
                "content": [
                    {**_chat_logprob(t), "top_logprobs": [_chat_logprob(x) for x in t.top]} for t in tokens
                ],
                "refusal": None,
            }
        # With echo the prompt's tokens come first: the first has no logprob (nor top ones).
        prompt: list[tuple[str, TokenLogprob | None]] = []
        for e in entries if self.echo else ():
            scored = e.data.get("prompt_logprobs") or ()
            for text, lp in zip(e.data.get("prompt_tokens") or (), scored, strict=True):
                prompt.append((text, None if lp is None else TokenLogprob.model_validate(lp)))
        texts = [text for text, _ in prompt] + [t.token for t in tokens]
        offsets = list(itertools.accumulate((len(t) for t in texts), initial=0))[:-1]
        return {
            "tokens": texts,
            "token_logprobs": [None if lp is None else lp.logprob for _, lp in prompt]
            + [t.logprob for t in tokens],
            "top_logprobs": [None if lp is None else {x.token: x.logprob for x in lp.top} for _, lp in prompt]
            + [{x.token: x.logprob for x in t.top} for t in tokens],
            "text_offset": offsets,
        }


def _vllm_prompt_logprobs(entries: Sequence[LogEntry]) -> list[dict[str, Any] | None] | None:
    """vLLM's prompt_logprobs from the first entry that has them: per prompt token None (the
    first) or {token id: {"logprob", "decoded_token"}} for the token and the top ones (no "rank")."""
    for e in entries:
        if (scored := e.data.get("prompt_logprobs")) is not None:
            out: list[dict[str, Any] | None] = []
            for raw in scored:
                if raw is None:
                    out.append(None)
                    continue
                lp = TokenLogprob.model_validate(raw)
                out.append(
                    {
                        str(t.token_id): {"logprob": t.logprob, "decoded_token": t.token}
                        for t in [*lp.top, lp]  # the token's own last: it wins a tie
                    }
                )
            return out
    return None


def _chat_logprob(t: TopLogprob) -> dict[str, Any]:
    return {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())}


def _event(sid: str, body: dict[str, Any]) -> ServerSentEvent:
    return ServerSentEvent(id=sid, raw_data=json.dumps(body, ensure_ascii=False, separators=(",", ":")))


class ToolStream:
    """A chat stream with tools: text outside calls streams as content, each call as it closes
    (a chunk with its index, id and name, then one with its arguments), and a turn that called
    ends with finish_reason "tool_calls". It keeps what it has read, so one per stream."""

    def __init__(self, calls: CallStream, view: View) -> None:
        self._calls = calls
        self._view = view
        self._count = 0  # calls streamed so far

    def prime(self, entries: Sequence[LogEntry]) -> None:
        """Read the entries a resumed stream already had, without sending them."""
        for entry in entries:
            self.render(entry)

    def render(self, entry: LogEntry) -> list[ServerSentEvent]:
        view, sid = self._view, str(entry.seq)
        if entry.type == "error":
            return view.render(entry)
        if view.running_usage is not None:
            view.running_usage.count(entry)
        if entry.type == "token":
            first = entry.data["index"] == 0
            chunks = self._pieces(sid, self._calls.feed(entry.data["text"]), first)
            return chunks or (
                [view.part_chunk(sid, {"delta": {"role": "assistant", "content": ""}}, None)] if first else []
            )
        chunks = self._pieces(sid, self._calls.end(), entry.seq == 1)
        reason = entry.data["finish_reason"]
        reason = "tool_calls" if self._count and reason == "stop" else reason
        delta = {"role": "assistant"} if entry.seq == 1 and not chunks else {}
        chunks.append(view.part_chunk(sid, {"delta": delta}, reason))
        if view.include_usage:
            usage = Usage.model_validate(entry.data["usage"]).model_dump()
            chunks.append(_event(sid, {**view._chunk_head(), "choices": [], "usage": usage}))
        return [*chunks, DONE]

    def _pieces(self, sid: str, pieces: Iterable[str | Call], first: bool) -> list[ServerSentEvent]:
        chunks = []
        for piece in pieces:
            if isinstance(piece, str):
                delta: dict[str, Any] = {"content": piece}
            elif self._view.single_call and self._count:
                continue
            else:
                call = self._view.call_json(self._count, piece)
                head = {**call, "function": {"name": piece.name, "arguments": ""}}
                chunks.append(self._delta(sid, {"tool_calls": [{"index": self._count, **head}]}, first))
                first = False
                delta = {"tool_calls": [{"index": self._count, "function": {"arguments": piece.arguments}}]}
                self._count += 1
            chunks.append(self._delta(sid, delta, first))
            first = False
        return chunks

    def _delta(self, sid: str, delta: dict[str, Any], first: bool) -> ServerSentEvent:
        return self._view.part_chunk(sid, {"delta": {"role": "assistant", **delta} if first else delta}, None)
