"""The jobs this machine's ``spool`` submitted, kept in a small local file.

The API has no listing of jobs (a job is found by its id), so ``spool jobs`` lists what
``spool generate`` and ``spool batch`` recorded here when the API named each job: the file is
``$XDG_STATE_HOME/spool/jobs.jsonl`` (default ``~/.local/state/spool/jobs.jsonl``), one JSON
object a line, the newest ``KEEP`` kept.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

KEEP = 500  # entries kept; older ones go when the file reaches twice as many
WHAT_CHARS = 60  # of the prompt, to tell jobs apart in the listing


def path() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "spool" / "jobs.jsonl"


def record(job_id: str, url: str, what: str, via: str) -> None:
    """Add a job; a file that cannot be written costs the listing, never the command."""
    entry = {"id": job_id, "url": url, "at": time.time(), "what": what[:WHAT_CHARS], "via": via}
    file = path()
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with file.open("a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
        _trim(file)
    except OSError:
        pass


def _trim(file: Path) -> None:
    lines = file.read_text(encoding="utf-8").splitlines(keepends=True)
    if len(lines) >= 2 * KEEP:
        tmp = file.with_suffix(".tmp")
        tmp.write_text("".join(lines[-KEEP:]), encoding="utf-8")
        tmp.replace(file)


def recent(url: str, limit: int) -> list[dict[str, Any]]:
    """The newest ``limit`` jobs submitted to ``url``, newest first."""
    try:
        lines = path().read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    entries = []
    for line in reversed(lines):
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash mid-write
        if isinstance(entry, dict) and entry.get("url") == url:
            entries.append(entry)
            if len(entries) == limit:
                break
    return entries


def describe(body: dict[str, Any]) -> str:
    """A job request's text, for the listing: its prompt, or its last message."""
    if isinstance(body.get("prompt"), str):
        return str(body["prompt"])
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        return str(messages[-1].get("content", ""))
    return ""
