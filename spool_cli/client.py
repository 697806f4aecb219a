"""``spool generate``, ``jobs``, ``job`` and ``cancel``: HTTP clients of a running API (httpx, no
torch); the batch file's reading for ``spool batch`` (spool_cli/batches.py).

Connections: an API that was never reached (connection refused, no such host) fails the command
at once with one line naming the URL; one that answered before and then went away (a replica
restarting, a dropped connection) is retried with back-off. Ctrl-C never loses a job: the
commands print the ids of the jobs they submitted and how to resume or cancel them (and ``spool
jobs`` lists them, from the API's ``GET /v1/jobs``).
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx

MAX_RECONNECTS = 20  # consecutive failed tries to reach the event stream before giving up
RETRY_STATUSES = {502, 503, 504}  # a replica restarting, Redis unreachable: try again
TIMEOUT = httpx.Timeout(30.0, read=120.0)  # the API pings idle streams every SPOOL_SSE_PING_S
PAGE_MAX = 100  # the most jobs one GET /v1/jobs answers with (its `limit`)
SECOND_CTRL_C_S = 2.0  # a second Ctrl-C within this long of the first cancels the job
INTERRUPTED = 130  # the shell's status for a command ended by SIGINT
NEVER_CONNECTED = (httpx.ConnectError, httpx.ConnectTimeout)
BATCH_ID_PREFIX = "batch_"  # `spool cancel` cancels these as batches
READY_HEADER = "X-Spool-Ready"  # "false" on a submit while no worker is live (the job waits)


class Unreachable(Exception):
    """The API at the URL never answered: nothing to retry (main prints the one line)."""

    def __init__(self, url: str, error: Exception) -> None:
        reason = str(error) or type(error).__name__
        super().__init__(f"cannot reach the API at {url} ({reason}); is it running? (scripts/serve.sh)")


class Api:
    """An httpx client that knows whether the API has answered it yet."""

    def __init__(self, url: str, api_key: str | None) -> None:
        self.url = url.rstrip("/")
        self.reached = False
        self.http = httpx.Client(
            base_url=self.url,
            headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
            timeout=TIMEOUT,
            event_hooks={"response": [self._answered]},
        )

    def _answered(self, _: httpx.Response) -> None:
        self.reached = True

    def lost(self, e: httpx.TransportError) -> None:
        """A connection failed: raise Unreachable if none was ever made, else return (retry)."""
        if isinstance(e, NEVER_CONNECTED) and not self.reached:
            raise Unreachable(self.url, e) from None

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _idempotency() -> dict[str, str]:
    """A submit's own key: sent again with a retried submit, the API answers with the job the
    first try made (if it made one) instead of making a second."""
    return {"Idempotency-Key": str(uuid.uuid4())}


def _back_off(failures: int) -> None:
    """Wait before trying again after ``failures`` failed tries in a row."""
    time.sleep(min(0.2 * failures, 5.0))


def _message(body: str) -> str | None:
    """The message of an error envelope, None for anything else."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return None


def _error(resp: httpx.Response) -> str:
    return _message(resp.text) or f"HTTP {resp.status_code}: {resp.text[:200]}"


def _say(line: str) -> None:
    print(f"spool: {line}", file=sys.stderr, flush=True)


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str, str, str]]:
    """(id, event, data) of each event of a text/event-stream; comments (pings) are skipped.

    The id is the event's own, "" when it has none: every job event has one; the stream's own
    error (Redis unreachable for too long) has none, and means "resume after the last id".
    """
    event_id, event, data = "", "message", list[str]()
    for line in lines:
        if not line:
            if data:
                yield event_id, event, "\n".join(data)
            event_id, event, data = "", "message", []
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "id":
            event_id = value
        elif name == "event":
            event = value
        elif name == "data":
            data.append(value)


# -- generate, and following a job's stream ------------------------------------------------------


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
    failures, submit_key = 0, _idempotency()
    while failures <= MAX_RECONNECTS:
        try:
            with _open(api, state, body, submit_key) as stream:
                if stream.is_error:
                    stream.read()
                    if state.job_id is None or stream.status_code not in RETRY_STATUSES:
                        _end_line(state)
                        _say(_error(stream))
                        return 1
                    _end_line(state)
                    _say(f"{_error(stream)}; resuming after event {state.last}")
                else:
                    if state.job_id is None:
                        _submitted(state, stream)
                    for event_id, event, data in sse_events(stream.iter_lines()):
                        if not event_id:  # the stream's own end (Redis unreachable), not the job's
                            _end_line(state)
                            _say(f"{_message(data) or data[:200]}; resuming after event {state.last}")
                            break
                        state.last, failures = event_id, 0
                        if (code := _show(api, state, event, json.loads(data))) is not None:
                            return code
        except httpx.TransportError as e:
            api.lost(e)
            _end_line(state)
            if state.job_id is None:  # the job may exist: its key makes the API answer with it
                _say(f"connection lost while submitting ({e}); submitting again")
            else:
                _say(f"connection lost ({e}); resuming after event {state.last}")
        failures += 1
        _back_off(failures)
    _say(f"gave up on job {state.job_id or '(not submitted)'}")
    return 1


def _open(api: Api, state: Follow, body: dict[str, Any] | None, key: dict[str, str]) -> Any:
    if state.job_id is None:
        return api.http.stream("POST", "/v1/jobs", json={**(body or {}), "stream": True}, headers=key)
    return api.http.stream("GET", f"/v1/jobs/{state.job_id}/events", headers={"Last-Event-ID": state.last})


def _submitted(state: Follow, stream: httpx.Response) -> None:
    state.job_id = stream.headers["location"].rsplit("/", 1)[-1]
    if stream.headers.get(READY_HEADER) == "false":
        _say(f"no worker is running: job {state.job_id} waits in the queue until one starts")


def _end_line(state: Follow) -> None:
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
        _say(f"job {state.job_id} failed ({data['type']}): {data['message']}")
        return 1
    tokens = data["usage"]["completion_tokens"]
    job, _ = _get_job(api, str(state.job_id))
    _say(
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
    _end_line(state)
    if state.job_id is None:
        _say("interrupted before the API named the job (if it made one, it runs on)")
        return INTERRUPTED
    job = state.job_id
    try:  # (the message inside: a second Ctrl-C right after it still cancels)
        _say(
            f"interrupted; job {job} runs on. Resume: spool job {job} --follow; cancel: spool cancel {job} "
            f"(or press Ctrl-C again within {SECOND_CTRL_C_S:g} s)"
        )
        time.sleep(SECOND_CTRL_C_S)
    except KeyboardInterrupt:
        return _cancel(api, [job]) or INTERRUPTED
    return INTERRUPTED


# -- jobs, job, cancel ---------------------------------------------------------------------------


def _get_job(api: Api, job_id: str) -> tuple[dict[str, Any] | None, str | None]:
    """(job, None), or (None, the API's refusal): one try, an unreachable API raises."""
    try:
        resp = api.http.get(f"/v1/jobs/{job_id}")
    except httpx.TransportError as e:
        api.lost(e)
        return None, f"connection lost ({e})"
    if resp.is_error:
        return None, _error(resp)
    job: dict[str, Any] = resp.json()
    return job, None


def show_job(url: str, job_id: str, api_key: str | None) -> int:
    with Api(url, api_key) as api:
        job, error = _get_job(api, job_id)
    if job is None:
        _say(str(error))
        return 1
    print(json.dumps(job, indent=2, ensure_ascii=False))
    if job.get("status") == "queued" and job.get("queue_position") is not None:
        _say(queued_line(job["queue_position"], job.get("estimated_start_s")))
    return 0


def queued_line(position: int, estimate: float | None) -> str:
    """What ``spool job`` says of a queued job (on stderr: stdout stays the job's JSON)."""
    ahead = f"queued, {position} job{'' if position == 1 else 's'} ahead of it"
    if estimate is None:
        return f"{ahead}; no start estimate (no live worker of its model, or none of its jobs ended yet)"
    return f"{ahead}; expected to start in about {estimate:g} s"


def cancel_jobs(url: str, job_ids: list[str], api_key: str | None) -> int:
    with Api(url, api_key) as api:
        return _cancel(api, job_ids)


def _cancel(api: Api, job_ids: list[str]) -> int:
    """Cancel each job (a batch_... id: the batch); the exit code. A job that already ended is
    said, not an error."""
    code = 0
    for job_id in job_ids:
        if job_id.startswith(BATCH_ID_PREFIX):
            code = _cancel_batch(api, job_id) or code
            continue
        try:
            resp = api.http.post(f"/v1/jobs/{job_id}/cancel")
        except httpx.TransportError as e:
            api.lost(e)
            _say(f"job {job_id}: connection lost ({e}); not cancelled")
            code = 1
            continue
        if resp.status_code == 409:
            _say(f"job {job_id}: {_error(resp)}")
        elif resp.is_error:
            _say(f"job {job_id}: {_error(resp)}")
            code = 1
        else:
            _say(f"job {job_id}: cancel requested (its status now: {resp.json()['status']})")
    return code


def _cancel_batch(api: Api, batch_id: str) -> int:
    try:
        resp = api.http.post(f"/v1/batches/{batch_id}/cancel")
    except httpx.TransportError as e:
        api.lost(e)
        _say(f"batch {batch_id}: connection lost ({e}); not cancelled")
        return 1
    if resp.is_error:
        _say(f"batch {batch_id}: {_error(resp)}")
        return 0 if resp.status_code == 409 else 1
    _say(f"batch {batch_id}: cancel requested (its status now: {resp.json()['status']})")
    return 0


def list_workers(url: str, api_key: str | None) -> int:
    """The live workers (GET /console-status), one line each: kind, model, load."""
    with Api(url, api_key) as api:
        try:
            resp = api.http.get("/console-status")
        except httpx.TransportError as e:
            api.lost(e)
            _say(f"connection lost ({e})")
            return 1
    if resp.is_error:
        _say(_error(resp))
        return 1
    workers = sorted(resp.json()["workers"], key=lambda w: (w.get("kind", ""), w.get("model", "")))
    if not workers:
        _say("no live worker")
        return 0
    print(f"{'KIND':5}  {'MODEL':40}  LOAD")
    for w in workers:
        model = w.get("model") or "-"  # a hook worker serves no model
        print(f"{w.get('kind', 'text'):5}  {model:40}  {_load(w.get('engine') or {})}")
    return 0


def _load(engine: dict[str, Any]) -> str:
    """A worker's load, from its heartbeat's engine figures."""
    if "slots" in engine:  # a text worker's engine stats
        return f"{engine['running']} running of {engine['slots']} slots, {engine['waiting']} waiting"
    if "step" in engine:  # a media worker with a part
        return f"1 image part, step {engine['step']} of {engine['steps']}"
    return f"{engine.get('running', 0)} running"


def list_jobs(url: str, limit: int, status: str | None, api_key: str | None) -> int:
    """The newest ``limit`` jobs of the API key (without keys: every job), whichever client
    submitted them, as a table; ``status``: only jobs in that state."""
    with Api(url, api_key) as api:
        jobs, error = _listed(api, limit, status)
    if jobs:
        print(f"{'JOB':32}  {'STATUS':9}  {'TOKENS':>6}  {'CREATED':19}  MODEL")
        for job in jobs:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(job["created_at"]))
            tokens = job["usage"]["completion_tokens"]
            print(f"{job['id']:32}  {job['status']:9}  {tokens:>6}  {when:19}  {job['model'] or '-'}")
    if error is not None:
        _say(error)
        return 1
    if not jobs:
        _say(f"no {status} jobs" if status else "no jobs")
    return 0


def _listed(api: Api, limit: int, status: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """(up to ``limit`` jobs, newest first; None or the error that ended the listing early):
    page after page, each from the last one's ``last_id``. A page may be short and still have
    more (the API reads a bounded part of the index per page), so ``has_more`` decides."""
    jobs: list[dict[str, Any]] = []
    params: dict[str, Any] = {"status": status} if status else {}
    while len(jobs) < limit:
        params["limit"] = min(limit - len(jobs), PAGE_MAX)
        page, error = _page(api, params)
        if page is None:
            return jobs, error
        jobs += page["data"]
        if not page["has_more"]:
            break
        params["after"] = page["last_id"]
    return jobs, None


def _page(api: Api, params: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """(one page of GET /v1/jobs, None) or (None, the error); a lost connection or a 502, 503 or
    504 is tried again with back-off, up to ``MAX_RECONNECTS`` times."""
    failures = 0
    while True:
        try:
            resp = api.http.get("/v1/jobs", params=params)
        except httpx.TransportError as e:
            api.lost(e)
            error = f"connection lost ({e})"
        else:
            if resp.status_code not in RETRY_STATUSES:
                return (None, _error(resp)) if resp.is_error else (resp.json(), None)
            error = _error(resp)
        failures += 1
        if failures > MAX_RECONNECTS:
            return None, error
        _back_off(failures)


# -- batch ---------------------------------------------------------------------------------------


class BadBatch(ValueError):
    """The input file cannot be read or a line is not a job: nothing was submitted."""


def read_batch(file: Path) -> list[dict[str, Any]]:
    """Every job of a JSONL file, all checked before any is submitted (blank lines skipped)."""
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadBatch(f"no such file: {file}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadBatch(f"cannot read {file}: {e}") from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise BadBatch(f"{file} line {number}: not JSON ({e}); nothing submitted") from None
        if not isinstance(row, dict):
            raise BadBatch(f"{file} line {number}: not a JSON object (a job request); nothing submitted")
        rows.append(row)
    return rows
