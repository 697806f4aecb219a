"""``spool generate`` and ``spool batch``: HTTP clients of a running API (httpx, no torch)."""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

TERMINAL = {"succeeded", "failed", "cancelled", "partial"}
MAX_RECONNECTS = 20  # consecutive failed tries to reach the event stream before giving up
RETRY_STATUSES = {502, 503, 504}  # a replica restarting, Redis unreachable: try again
POLL_S = 0.5  # between two rounds of status checks in `spool batch`
TIMEOUT = httpx.Timeout(30.0, read=120.0)  # the API pings idle streams every SPOOL_SSE_PING_S


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


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


def generate(url: str, body: dict[str, Any], api_key: str | None) -> int:
    """Submit with ``"stream": true`` and print the tokens as they arrive; after a drop, resume
    the job's stream with Last-Event-ID (or, before the job's id came back, submit again with
    the same Idempotency-Key)."""
    with httpx.Client(base_url=url, headers=_headers(api_key), timeout=TIMEOUT) as client:
        job_id: str | None = None  # known from the submit's Location header on
        last, failures, submit_key = "0", 0, _idempotency()
        while failures <= MAX_RECONNECTS:
            try:
                with (
                    client.stream("POST", "/v1/jobs", json={**body, "stream": True}, headers=submit_key)
                    if job_id is None
                    else client.stream("GET", f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": last})
                ) as stream:
                    if stream.is_error:
                        stream.read()
                        if job_id is None:  # the submit itself was refused
                            print(f"spool: {_error(stream)}", file=sys.stderr)
                            return 1
                        if stream.status_code not in RETRY_STATUSES:
                            print(f"\nspool: {_error(stream)}", file=sys.stderr)
                            return 1
                        print(f"\nspool: {_error(stream)}; resuming after event {last}", file=sys.stderr)
                    else:
                        job_id = job_id or stream.headers["location"].rsplit("/", 1)[-1]
                        for event_id, event, data in sse_events(stream.iter_lines()):
                            if not event_id:  # the stream's own end (Redis unreachable), not the job's
                                message = _message(data) or data[:200]
                                print(f"\nspool: {message}; resuming after event {last}", file=sys.stderr)
                                break
                            last, failures = event_id, 0
                            if (code := _show(event, json.loads(data))) is not None:
                                return code
            except httpx.TransportError as e:
                if job_id is None:  # the job may exist: its key makes the API answer with it
                    print(f"spool: connection lost while submitting ({e}); submitting again", file=sys.stderr)
                else:
                    print(f"\nspool: connection lost ({e}); resuming after event {last}", file=sys.stderr)
            failures += 1
            _back_off(failures)
        print(f"spool: gave up on job {job_id or '(not submitted)'}", file=sys.stderr)
        return 1


def _show(event: str, data: dict[str, Any]) -> int | None:
    """Print one event; the exit code once the job ended, else None."""
    if event == "token":
        print(data["text"], end="", flush=True)
        return None
    print()
    if event == "error":
        print(f"spool: job failed ({data['type']}): {data['message']}", file=sys.stderr)
        return 1
    return 0 if data["status"] == "succeeded" else 1


def _submit(client: httpx.Client, body: dict[str, Any]) -> tuple[str | None, str | None]:
    """(job id, None) or (None, error message); waits out a full queue (429 + Retry-After) and
    submits again after a lost connection (with the same Idempotency-Key: one job at most)."""
    key, failures = _idempotency(), 0
    while True:
        try:
            resp = client.post("/v1/jobs", json=body, headers=key)
        except httpx.TransportError as e:
            failures += 1
            if failures > MAX_RECONNECTS:
                return None, f"could not submit ({e})"
            _back_off(failures)
            continue
        if resp.status_code != 429:
            return (None, _error(resp)) if resp.is_error else (resp.json()["id"], None)
        time.sleep(float(resp.headers.get("Retry-After", "1")))


def _poll(client: httpx.Client, job_id: str) -> dict[str, Any] | None:
    """The job, or None while the API cannot answer (a replica restarting, Redis unreachable)."""
    try:
        resp = client.get(f"/v1/jobs/{job_id}")
    except httpx.TransportError:
        return None
    if resp.status_code in RETRY_STATUSES:
        return None
    resp.raise_for_status()
    job: dict[str, Any] = resp.json()
    return job


def batch(url: str, file: Path, out: Path | None, api_key: str | None) -> int:
    rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    results: list[dict[str, Any]] = []
    with httpx.Client(base_url=url, headers=_headers(api_key), timeout=TIMEOUT) as client:
        for row in rows:
            custom_id = row.pop("custom_id", None)
            job_id, error = _submit(client, {**row, "stream": False})  # polled, never streamed
            result: dict[str, Any] = {"custom_id": custom_id, "job_id": job_id}
            if error:
                result.update(status="rejected", error={"message": error, "type": "rejected"})
            results.append(result)
        pending = {r["job_id"]: r for r in results if r["job_id"] and "status" not in r}
        while pending:
            for job_id in list(pending):  # in submission order
                if (job := _poll(client, job_id)) is None:
                    break  # try again next round
                if job["status"] == "queued":
                    # The workers take jobs in the order they were queued: the jobs after this
                    # one wait too. (Polling them all each round costs the API a request per
                    # queued job every POLL_S: a 1,000-line batch would keep it busy.)
                    break
                if job["status"] in TERMINAL:
                    pending.pop(job_id).update(
                        {k: job.get(k) for k in ("status", "text", "finish_reason", "usage", "error")}
                    )
            if pending:
                time.sleep(POLL_S)
    text = "".join(json.dumps(r) + "\n" for r in results)
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
    return 0 if all(r["status"] == "succeeded" for r in results) else 1
