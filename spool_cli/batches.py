"""``spool batch`` and ``spool batches``: a JSONL file run as one batch of the Batches API (httpx).

The file is uploaded (``POST /v1/files``), the batch created (``POST /v1/batches``) and polled with
a progress line on stderr. Once it ended, its output and error files are downloaded. The batch
runs on the server, so an interrupted command (Ctrl-C, a lost connection) is picked up again with
``spool batch --resume BATCH_ID``.

A line is an OpenAI batch line (``{"custom_id", "method", "url", "body"}``), or a bare job request
(``{"prompt" | "messages", ...}`` with an optional ``custom_id``). A bare request is sent as a
line for ``/v1/jobs``, with the custom_id given or else ``line-N``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import httpx

from spool_cli.client import INTERRUPTED, RETRY_STATUSES, SECOND_CTRL_C_S, Api, error_text

POLL_S = 1.0
ENDED = {"completed", "failed", "expired", "cancelled"}
BAR = 24  # characters of the progress bar


class BatchError(RuntimeError):
    """The API refused something: the message is its error envelope's."""


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


def _check(resp: httpx.Response) -> dict[str, Any]:
    if resp.status_code >= 400:
        raise BatchError(error_text(resp))
    return dict(resp.json())


def batch_lines(rows: list[dict[str, Any]], out: IO[str]) -> str:
    """Write the rows to ``out`` as batch lines; returns their endpoint (the one url they share)."""
    endpoints: set[str] = set()
    for n, row in enumerate(rows, 1):
        if "body" not in row:  # a bare job request
            custom_id = row.pop("custom_id", None)
            row = {"custom_id": custom_id or f"line-{n}", "method": "POST", "url": "/v1/jobs", "body": row}
        endpoints.add(str(row.get("url")))
        out.write(json.dumps(row) + "\n")
    if len(endpoints) != 1:
        raise BatchError(
            f"the lines must all name one url (endpoint); they name {sorted(endpoints) or 'none'}"
        )
    return endpoints.pop()


def submit(api: Api, file: Path, webhook: str | None = None) -> dict[str, Any]:
    """Upload ``file`` as batch lines (each checked first: a bad one submits nothing) and create its batch."""
    rows = read_batch(file)
    with tempfile.TemporaryFile("w+") as lines:
        endpoint = batch_lines(rows, lines)
        lines.seek(0)
        files = {"file": (file.name, lines.buffer)}
        uploaded = _check(_call(api, "POST", "/v1/files", data={"purpose": "batch"}, files=files))
    body = {"input_file_id": uploaded["id"], "endpoint": endpoint, "completion_window": "24h"}
    if webhook is not None:
        body["webhook"] = webhook
    return _check(_call(api, "POST", "/v1/batches", json=body))


def _call(api: Api, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """One request; an API that never answered raises Unreachable (main prints the one line)."""
    try:
        return api.http.request(method, path, **kwargs)
    except httpx.TransportError as e:
        api.lost(e)
        raise BatchError(f"the API went away ({e}); if the batch was created: spool batches") from None


def progress(batch: dict[str, Any], started: float, done_at_start: int) -> str:
    counts = batch["request_counts"]
    total, completed, failed = counts["total"], counts["completed"], counts["failed"]
    done = completed + failed
    filled = BAR * done // total if total else 0
    elapsed = time.monotonic() - started
    rate = (done - done_at_start) / elapsed if elapsed > 0 else 0.0
    left = f", ~{(total - done) / rate:.0f}s left" if rate > 0 and total > done else ""
    return (
        f"[{'#' * filled}{'.' * (BAR - filled)}] {done}/{total} ({completed} completed, {failed} failed) "
        f"{batch['status']}, {rate:.1f} lines/s{left}"
    )


def follow(api: Api, batch_id: str) -> dict[str, Any]:
    """Poll the batch until it ended, a progress line on stderr; returns it."""
    started, first = time.monotonic(), None
    while True:
        try:
            resp = api.http.get(f"/v1/batches/{batch_id}")
        except httpx.TransportError as e:
            api.lost(e)
            resp = None  # gone for a moment (a replica restarting): poll again
        if resp is not None and resp.status_code not in RETRY_STATUSES:
            batch = _check(resp)
            counts = batch["request_counts"]
            first = counts["completed"] + counts["failed"] if first is None else first
            print("\r" + progress(batch, started, first), end="", file=sys.stderr, flush=True)
            if batch["status"] in ENDED:
                print(file=sys.stderr)
                return batch
        time.sleep(POLL_S)


def download(api: Api, file_id: str | None, dest: Path) -> int:
    """Write the file's content to ``dest`` (an empty file when there is none); its line count."""
    lines = 0
    with dest.open("wb") as out:
        if file_id:
            with api.http.stream("GET", f"/v1/files/{file_id}/content") as resp:
                if resp.status_code >= 400:
                    resp.read()
                    _check(resp)
                for chunk in resp.iter_bytes():
                    out.write(chunk)
                    lines += chunk.count(b"\n")
    return lines


def run(
    url: str,
    file: Path | None,
    resume: str | None,
    out: Path | None,
    errors: Path | None,
    api_key: str | None,
    webhook: str | None = None,
) -> int:
    """``spool batch``: 0 when every line succeeded, 1 when some failed or the batch did not complete."""
    with Api(url, api_key) as api:
        try:
            batch_id = submit(api, file, webhook)["id"] if file is not None else str(resume)
            # The results go beside the input (or beside --out), never loose in the working directory.
            named = file if file is not None else out
            stem = str(named.with_suffix("")).removesuffix(".output") if named is not None else batch_id
            try:
                print(
                    f"batch {batch_id} (resume with: spool batch --resume {batch_id})",
                    file=sys.stderr,
                    flush=True,
                )
                batch = follow(api, batch_id)
            except KeyboardInterrupt:
                return _interrupted(api, batch_id)
            out, errors = out or Path(f"{stem}.output.jsonl"), errors or Path(f"{stem}.errors.jsonl")
            n_out = download(api, batch["output_file_id"], out)
            n_err = download(api, batch["error_file_id"], errors)
        except BatchError as e:
            print(f"spool batch: {e}", file=sys.stderr)
            return 1
    print(f"{batch['status']}: {n_out} line(s) in {out}, {n_err} in {errors}", file=sys.stderr)
    for error in (batch.get("errors") or {}).get("data") or []:
        print(f"  line {error.get('line')}: {error.get('message')} ({error.get('code')})", file=sys.stderr)
    return 0 if batch["status"] == "completed" and n_err == 0 else 1


def _interrupted(api: Api, batch_id: str) -> int:
    """The batch runs on; a second Ctrl-C soon after cancels it."""
    try:
        print(
            f"\ninterrupted; the batch runs on on the server: spool batch --resume {batch_id}; "
            f"cancel it: press Ctrl-C again within {SECOND_CTRL_C_S:g} s",
            file=sys.stderr,
        )
        time.sleep(SECOND_CTRL_C_S)
    except KeyboardInterrupt:
        status = _check(_call(api, "POST", f"/v1/batches/{batch_id}/cancel"))["status"]
        print(f"batch {batch_id}: {status}", file=sys.stderr)
    return INTERRUPTED


def list_batches(url: str, limit: int, api_key: str | None) -> int:
    """``spool batches``: the newest batches, one line each."""
    with Api(url, api_key) as api:
        try:
            batches = _check(_call(api, "GET", "/v1/batches", params={"limit": limit}))["data"]
        except BatchError as e:
            print(f"spool batches: {e}", file=sys.stderr)
            return 1
    for b in batches:
        c = b["request_counts"]
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(b["created_at"]))
        print(
            f"{b['id']}  {b['status']:<11} {c['completed']}/{c['total']} completed, {c['failed']} failed  {created}  {b['endpoint']}"
        )
    return 0
