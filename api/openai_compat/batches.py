"""OpenAI's file and batch objects, and a batch's result lines, from what the store keeps."""

from __future__ import annotations

from typing import Any

from common.schemas.views import int_or_none

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/jobs")
COMPLETION_WINDOWS = {"24h": 24 * 3600}


def file_object(h: dict[str, str]) -> dict[str, Any]:
    return {
        "id": h["id"],
        "object": "file",
        "bytes": int(h["bytes"]),
        "created_at": int(float(h["created_at"])),
        "expires_at": int_or_none(h.get("expires_at")),
        "filename": h["filename"],
        "purpose": h["purpose"],
        "status": "processed",
        "status_details": None,
    }


def page(objects: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's cursor page: the objects after the one named ``after`` (newest first)."""
    if after is not None:
        ids = [o["id"] for o in objects]
        objects = objects[ids.index(after) + 1 :] if after in ids else []
    data = objects[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(objects) > limit,
    }


def response_line(job_id: str, custom_id: str, status_code: int, body: dict[str, Any]) -> dict[str, Any]:
    """A line that the endpoint answered (an output line, or an error line for a 4xx/5xx)."""
    return {
        "id": f"batch_req_{job_id}",
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": job_id, "body": body},
        "error": None,
    }


def error_line(line_id: str, custom_id: str, code: str, message: str) -> dict[str, Any]:
    """A line that got no answer: the batch was cancelled or expired first."""
    return {
        "id": f"batch_req_{line_id}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
