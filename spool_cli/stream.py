"""``spool generate`` and ``spool job --follow``: a job's tokens printed as they come, its stream
resumed after a drop (spool_cli/client.py says how connections are retried)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from spool_cli.client import (
    INTERRUPTED,
    MAX_RECONNECTS,
    RETRY_STATUSES,
    SECOND_CTRL_C_S,
    Api,
    back_off,
    error_message,
    error_text,
    idempotency_key,
    say,
    sse_events,
)
from spool_cli.jobs import cancel, get_job

READY_HEADER = "X-Spool-Ready"  # "false" on a submit while no worker is live (the job waits)


@dataclass
class Follow:
    """Where a client is in one job's stream."""

    job_id: str | None  # None until the submit's answer named the job
    started: float | None  # monotonic time of the submit; None: following a job submitted earlier
    last: str = "0"  # id of the last event shown
    newline: bool = False  # the terminal's cursor is after some text
    text: list[str] = field(default_factory=list)  # the tokens' text shown so far


def generate(url: str, body: dict[str, Any], api_key: str | None) -> int:
    """Submit with ``"stream": true`` and print the tokens as they arrive; after a drop, resume
    the job's stream with Last-Event-ID (or, before the job's id came back, submit again with
    the same Idempotency-Key). Ctrl-C: see ``interrupted``."""
    state = Follow(None, time.monotonic())
    with Api(url, api_key) as api:
        try:
            return stream_job(api, state, body)
        except KeyboardInterrupt:
            return interrupted(api, state)


def follow(url: str, job_id: str, api_key: str | None) -> int:
    """Print a job's text from its first token to its end, as ``generate`` does (resume after Ctrl-C)."""
    state = Follow(job_id, None)
    with Api(url, api_key) as api:
        try:
            return stream_job(api, state, None)
        except KeyboardInterrupt:
            return interrupted(api, state)


def stream_job(api: Api, state: Follow, body: dict[str, Any] | None) -> int:
    """Submit ``body`` (or, when None, follow ``state.job_id``) and print its tokens until it
    ends, resuming after a drop; the exit code. Ctrl-C propagates (see ``interrupted``)."""
    failures, submit_key = 0, idempotency_key()
    while failures <= MAX_RECONNECTS:
        try:
            with _open(api, state, body, submit_key) as stream:
                if stream.is_error:
                    stream.read()
                    if state.job_id is None or stream.status_code not in RETRY_STATUSES:
                        end_line(state)
                        say(error_text(stream))
                        return 1
                    end_line(state)
                    say(f"{error_text(stream)}; resuming after event {state.last}")
                else:
                    if state.job_id is None:
                        _submitted(state, stream)
                    for event_id, event, data in sse_events(stream.iter_lines()):
                        if not event_id:  # the stream's own end (Redis unreachable), not the job's
                            end_line(state)
                            say(f"{error_message(data) or data[:200]}; resuming after event {state.last}")
                            break
                        state.last, failures = event_id, 0
                        if (code := _show(api, state, event, json.loads(data))) is not None:
                            return code
        except httpx.TransportError as e:
            api.lost(e)
            end_line(state)
            if state.job_id is None:  # the job may exist: its key makes the API answer with it
                say(f"connection lost while submitting ({e}); submitting again")
            else:
                say(f"connection lost ({e}); resuming after event {state.last}")
        failures += 1
        back_off(failures)
    say(f"gave up on job {state.job_id or '(not submitted)'}")
    return 1


def _open(api: Api, state: Follow, body: dict[str, Any] | None, key: dict[str, str]) -> Any:
    if state.job_id is None:
        return api.http.stream("POST", "/v1/jobs", json={**(body or {}), "stream": True}, headers=key)
    return api.http.stream("GET", f"/v1/jobs/{state.job_id}/events", headers={"Last-Event-ID": state.last})


def _submitted(state: Follow, stream: httpx.Response) -> None:
    state.job_id = stream.headers["location"].rsplit("/", 1)[-1]
    if stream.headers.get(READY_HEADER) == "false":
        say(f"no worker is running: job {state.job_id} waits in the queue until one starts")


def end_line(state: Follow) -> None:
    """On a terminal, start a message on a line of its own after the text shown so far (the
    newline goes to stderr: stdout carries the job's text and nothing else)."""
    if state.newline:
        print(file=sys.stderr, flush=True)
        state.newline = False


def _show(api: Api, state: Follow, event: str, data: dict[str, Any]) -> int | None:
    """Print one event; the exit code once the job ended, else None."""
    if event == "token":
        print(data["text"], end="", flush=True)
        state.text.append(data["text"])
        state.newline = state.newline or bool(data["text"])
        return None
    print(flush=True)  # the text's end (an empty line for a job with none)
    state.newline = False
    if event == "error":
        say(f"job {state.job_id} failed ({data['type']}): {data['message']}")
        return 1
    tokens = data["usage"]["completion_tokens"]
    job, _ = get_job(api, str(state.job_id))
    say(
        f"{data['status']} (finish reason {data['finish_reason']}), {tokens} tokens"
        f"{_timing(tokens, job or {})}, job {state.job_id}"
    )
    return 0 if data["status"] == "succeeded" else 1


def _timing(tokens: int, job: dict[str, Any]) -> str:
    """The job's rate over its generation alone (a worker took it until it ended) and its wait
    in the queue before, from the job's own timestamps; "" when they are missing."""
    created, started, finished = job.get("created_at"), job.get("started_at"), job.get("finished_at")
    if created is None or started is None or finished is None:
        return ""
    generation = max(finished - started, 1e-3)
    return (
        f" in {generation:.1f} s ({tokens / generation:.1f} tok/s)"
        f" after {max(started - created, 0.0):.1f} s in the queue"
    )


def interrupted(api: Api, state: Follow) -> int:
    """Ctrl-C: the job runs on (it is a background job); say how to resume or cancel it, and
    cancel it if a second Ctrl-C comes within ``SECOND_CTRL_C_S``."""
    end_line(state)
    if state.job_id is None:
        say("interrupted before the API named the job (if it made one, it runs on)")
        return INTERRUPTED
    job = state.job_id
    try:  # (the message inside: a second Ctrl-C right after it still cancels)
        say(
            f"interrupted; job {job} runs on. Resume: spool job {job} --follow; cancel: spool cancel {job} "
            f"(or press Ctrl-C again within {SECOND_CTRL_C_S:g} s)"
        )
        time.sleep(SECOND_CTRL_C_S)
    except KeyboardInterrupt:
        return cancel(api, [job]) or INTERRUPTED
    return INTERRUPTED
