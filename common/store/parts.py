"""A job's parts as the store reads them: which image parts are held, the reads of the parts'
hashes and texts, their views in ``Job.parts``, and their events in the job's log
(docs/internals.md, "Parts")."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from common.keys import Keys, part_id
from common.schemas.events import LogEntry
from common.schemas.requests import ImagePart
from common.schemas.views import JobSummary, Usage
from common.store.records import JobRecord, P, float_or_none


def held_parts(parts: Sequence[Any], hold_s: float) -> list[int]:
    """The image parts whose message waits for their job's text parts' first tokens (or their end),
    at most ``hold_s`` (SPOOL_IMAGE_HOLD_S): those with a prompt of their own in a job with text
    parts (a ``prompt_from`` part waits for its text part's end anyway)."""
    if hold_s <= 0 or not any(p.type == "text" for p in parts):
        return []
    return [k for k, p in enumerate(parts) if isinstance(p, ImagePart) and p.prompt_from is None]


def part_reads(pipe: P, keys: Keys, job_id: str, n: int) -> P:
    """Queue the reads of a job's parts: each one's hash and text."""
    for k in range(n):
        pipe.hgetall(keys.job(part_id(job_id, k)))
        pipe.get(keys.job_text(part_id(job_id, k)))
    return pipe


IMAGE_RESULT = ("url", "content_type", "width", "height", "seed")  # an image part's summary fields shown


def part_view(h: dict[str, str], text: str | None) -> dict[str, Any]:
    """A part as ``Job.parts`` shows it (docs/internals.md, "Parts")."""
    view: dict[str, Any] = {
        "index": int(h["index"]),
        "type": h["type"],
        "status": h["status"],
        "error": json.loads(h["error"]) if h.get("error") else None,
        "attempt": int(h.get("attempt") or 0),
        "started_at": float_or_none(h.get("started_at")),
        "finished_at": float_or_none(h.get("finished_at")),
    }
    if h["type"] == "text":
        usage = Usage.of(int(h.get("prompt_tokens") or 0), int(h.get("completion_tokens") or 0))
        view.update(text=text or "", finish_reason=h.get("finish_reason") or None, usage=usage.model_dump())
    else:
        summary = json.loads(h["summary"]) if h.get("summary") else {}
        view.update({k: summary[k] for k in IMAGE_RESULT if k in summary})
    return view


def summary_with_parts(summary: JobSummary, hashes: Sequence[dict[str, str]]) -> JobSummary:
    """A listed job's summary with its parts' views (without their texts), usage their sum."""
    parts = [{k: v for k, v in part_view(h, None).items() if k != "text"} for h in hashes if h]
    usages = [p["usage"] for p in parts if "usage" in p]
    usage = Usage.of(sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages))
    return summary.model_copy(update={"parts": parts, "usage": usage})


def with_parts(record: JobRecord, hashes: Sequence[dict[str, str]], texts: Sequence[str | None]) -> JobRecord:
    """A job's record with its parts' views, and its usage their sum."""
    parts = [part_view(h, t) for h, t in zip(hashes, texts, strict=True) if h]
    usages = [p["usage"] for p in parts if "usage" in p]
    usage = Usage.of(sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages))
    job = record.job.model_copy(update={"parts": parts, "usage": usage})
    return JobRecord(
        job, record.request, record.owner, record.attempt, record.worker, record.cancel_requested
    )


def own_events(log: Iterable[LogEntry], index: int) -> list[LogEntry]:
    """A part's own events (tokens, progress, previews) in the job's log, numbered as the part counts them:
    what its worker resumes from, as a text job's worker does from its log."""
    mine = [e for e in log if e.type in ("token", "progress", "preview") and e.data.get("part") == index]
    return [e.model_copy(update={"seq": n}) for n, e in enumerate(mine, 1)]


def as_part_entry(entry: LogEntry, index: int) -> LogEntry:
    """A text worker's entry for a text part: tokens carry the part; the terminal event becomes
    the part's end (the job's own done comes once every part has ended)."""
    data = entry.data
    if entry.type == "token":
        return entry.model_copy(update={"data": {"part": index, **data}})
    if entry.type == "done":
        end = {
            "part": index,
            "status": data["status"],
            "finish_reason": data["finish_reason"],
            "usage": data["usage"],
        }
        return LogEntry.part_status(entry.seq, end)
    if entry.type == "error":
        error = {"message": data["message"], "type": data["type"]}
        return LogEntry.part_status(entry.seq, {"part": index, "status": "failed", "error": error})
    return entry
