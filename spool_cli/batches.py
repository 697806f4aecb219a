"""``spool batch`` and ``spool batches``: a JSONL file run as one batch of the Batches API (httpx).

The file is uploaded (``POST /v1/files``), the batch created (``POST /v1/batches``) and polled with
a progress line on stderr; once it ended its output and error files are downloaded. The batch
runs on the server: an interrupted command (Ctrl-C, a lost connection) is picked up again with
``spool batch --resume BATCH_ID``.

A line is an OpenAI batch line (``{"custom_id", "method", "url", "body"}``), or a bare job request
(``{"prompt" | "messages", ...}``, an optional ``custom_id``), which is sent as a line for
``/v1/jobs`` (its custom_id: the one given, else ``line-N``).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import httpx

POLL_S = 1.0
RETRY_STATUSES = {502, 503, 504}  # a replica restarting, Redis unreachable: poll again
TIMEOUT = httpx.Timeout(30.0, read=300.0)
ENDED = {"completed", "failed", "expired", "cancelled"}
BAR = 24  # characters of the progress bar


class BatchError(RuntimeError):
    """The API refused something: the message is its error envelope's."""


def _check(resp: httpx.Response) -> dict[str, Any]:
    if resp.status_code >= 400:
        try:
            message = resp.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {resp.status_code}: {resp.text[:200]}"
        raise BatchError(message)
    return dict(resp.json())


def batch_lines(src: IO[str], out: IO[str]) -> str:
    """Copy ``src`` to ``out`` as batch lines; returns their endpoint (the one url they share)."""
    endpoints: set[str] = set()
    for n, raw in enumerate(src, 1):
        if not raw.strip():
            continue
        row = json.loads(raw)
        if not isinstance(row, dict) or "body" not in row:  # a bare job request
            custom_id = row.pop("custom_id", None) if isinstance(row, dict) else None
            row = {"custom_id": custom_id or f"line-{n}", "method": "POST", "url": "/v1/jobs", "body": row}
        endpoints.add(str(row.get("url")))
        out.write(json.dumps(row) + "\n")
    if len(endpoints) != 1:
        raise BatchError(f"the lines must all name one url (endpoint); they name {sorted(endpoints) or 'none'}")
    return endpoints.pop()


def submit(client: httpx.Client, file: Path) -> dict[str, Any]:
    """Upload ``file`` as batch lines and create its batch."""
    with file.open() as src, tempfile.TemporaryFile("w+") as lines:
        endpoint = batch_lines(src, lines)
        lines.seek(0)
        uploaded = _check(
            client.post("/v1/files", data={"purpose": "batch"}, files={"file": (file.name, lines.buffer)})
        )
    body = {"input_file_id": uploaded["id"], "endpoint": endpoint, "completion_window": "24h"}
    return _check(client.post("/v1/batches", json=body))


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


def follow(client: httpx.Client, batch_id: str) -> dict[str, Any]:
    """Poll the batch until it ended, a progress line on stderr; returns it."""
    started, first = time.monotonic(), None
    while True:
        try:
            resp = client.get(f"/v1/batches/{batch_id}")
        except httpx.TransportError:
            resp = None
        if resp is not None and resp.status_code not in RETRY_STATUSES:
            batch = _check(resp)
            counts = batch["request_counts"]
            first = counts["completed"] + counts["failed"] if first is None else first
            print("\r" + progress(batch, started, first), end="", file=sys.stderr, flush=True)
            if batch["status"] in ENDED:
                print(file=sys.stderr)
                return batch
        time.sleep(POLL_S)


def download(client: httpx.Client, file_id: str | None, dest: Path) -> int:
    """Write the file's content to ``dest`` (an empty file when there is none); its line count."""
    lines = 0
    with dest.open("wb") as out:
        if file_id:
            with client.stream("GET", f"/v1/files/{file_id}/content") as resp:
                if resp.status_code >= 400:
                    resp.read()
                    _check(resp)
                for chunk in resp.iter_bytes():
                    out.write(chunk)
                    lines += chunk.count(b"\n")
    return lines


def run(
    url: str, file: Path | None, resume: str | None, out: Path | None, errors: Path | None, api_key: str | None
) -> int:
    """``spool batch``: 0 when every line succeeded, 1 when some failed or the batch did not complete."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=TIMEOUT) as client:
        try:
            if resume is None:
                assert file is not None
                batch_id = submit(client, file)["id"]
            else:
                batch_id = resume
            stem = str(file.with_suffix("")) if file is not None else batch_id
            print(f"batch {batch_id} (resume with: spool batch --resume {batch_id})", file=sys.stderr)
            try:
                batch = follow(client, batch_id)
            except KeyboardInterrupt:
                print(f"\ninterrupted; the batch goes on: spool batch --resume {batch_id}", file=sys.stderr)
                return 130
            out, errors = out or Path(f"{stem}.output.jsonl"), errors or Path(f"{stem}.errors.jsonl")
            n_out = download(client, batch["output_file_id"], out)
            n_err = download(client, batch["error_file_id"], errors)
        except BatchError as e:
            print(f"spool batch: {e}", file=sys.stderr)
            return 1
    print(f"{batch['status']}: {n_out} line(s) in {out}, {n_err} in {errors}", file=sys.stderr)
    for e in (batch.get("errors") or {}).get("data") or []:
        print(f"  line {e.get('line')}: {e.get('message')} ({e.get('code')})", file=sys.stderr)
    return 0 if batch["status"] == "completed" and n_err == 0 else 1


def list_batches(url: str, limit: int, api_key: str | None) -> int:
    """``spool batches``: the newest batches, one line each."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=TIMEOUT) as client:
        try:
            batches = _check(client.get("/v1/batches", params={"limit": limit}))["data"]
        except BatchError as e:
            print(f"spool batches: {e}", file=sys.stderr)
            return 1
    for b in batches:
        c = b["request_counts"]
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(b["created_at"]))
        print(f"{b['id']}  {b['status']:<11} {c['completed']}/{c['total']} completed, {c['failed']} failed  {created}  {b['endpoint']}")
    return 0
