"""Objects as the API's GET shows them, from the hashes the store keeps, for the API and for the
hook workers (a webhook's ``data``: common/webhooks.py)."""

from __future__ import annotations

import json
from typing import Any

_TIMESTAMPS = (
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)


def int_or_none(v: str | None) -> int | None:
    return int(float(v)) if v else None


def batch_object(h: dict[str, str]) -> dict[str, Any]:
    """The batch as OpenAI's API shows it; ``request_counts`` are live while it runs."""
    errors = json.loads(h["errors"]) if h.get("errors") else None
    return {
        "id": h["id"],
        "object": "batch",
        "endpoint": h["endpoint"],
        "errors": errors,
        "input_file_id": h["input_file_id"],
        "completion_window": h["completion_window"],
        "status": h["status"],
        "output_file_id": h.get("output_file_id") or None,
        "error_file_id": h.get("error_file_id") or None,
        "created_at": int(float(h["created_at"])),
        "expires_at": int_or_none(h.get("expires_at")),
        **{name: int_or_none(h.get(name)) for name in _TIMESTAMPS},
        "request_counts": {
            "total": int(h.get("total") or 0),
            "completed": int(h.get("completed") or 0),
            "failed": int(h.get("failed") or 0),
        },
        "metadata": json.loads(h["metadata"]) if h.get("metadata") else None,
    }
