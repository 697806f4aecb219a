"""The web console: static files from api/console/, and the cluster figures its page polls.

What the page shows: docs/console.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse

from api.auth import bearer_owner
from api.deps import ServicesDep
from api.errors import ApiError
from api.served import queued_models
from common.keys import split_part_id
from common.store import AsyncJobStore

CONSOLE_DIR = Path(__file__).resolve().parents[1] / "console"

ASSETS = {"console.js": "text/javascript", "console.css": "text/css"}

router = APIRouter(tags=["console"])


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def index() -> str:
    return (
        "<!doctype html><meta charset=utf-8><title>Spool</title>"
        "<h1>Spool</h1><ul><li><a href=/console>Console</a></li><li><a href=/docs>API docs</a></li>"
        "<li><a href=/readyz>Readiness</a></li><li><a href=/metrics>Metrics</a></li></ul>"
    )


@router.get("/console", include_in_schema=False)
async def console() -> FileResponse:
    return FileResponse(CONSOLE_DIR / "index.html", headers={"Cache-Control": "no-cache"})


@router.get("/console/{name}", include_in_schema=False)
async def console_asset(name: str) -> FileResponse:
    # Only the files the page names: no path from the URL reaches the file system.
    if name not in ASSETS:
        raise ApiError(404, f"No console file {name!r}", code="not_found")
    return FileResponse(CONSOLE_DIR / name, media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})


@router.get("/console-status")
async def console_status(services: ServicesDep, request: Request) -> dict[str, Any]:
    """What the console shows about the cluster: live workers with their kind (text, media) and
    engine figures (a text worker's engine stats; a media worker's step, and its part's id to
    the key that made it), and the queue depths. Public like /readyz; a 503 envelope when Redis
    is unreachable."""
    store = services.store
    workers, heartbeats = [], await store.list_workers()
    for w in heartbeats:
        shown = w.public()
        part = w.engine.get("part")
        if isinstance(part, str) and await _may_see(store, part, services.settings.api_key_set, request):
            shown["engine"]["part"] = part
        workers.append(shown)
    return {
        "workers": workers,
        "queued_jobs": await store.queued_count(),
        "queues": dict(await store.queue_depths(await queued_models(store))),
    }


async def _may_see(store: AsyncJobStore, part: str, keys: frozenset[str], request: Request) -> bool:
    """Without API keys, anyone; with them, the caller whose bearer key made the part's job (the
    middleware checks no key here: the path is public)."""
    if not keys:
        return True
    split, owner = split_part_id(part), bearer_owner(request.headers)
    return bool(owner) and split is not None and await store.owner(split[0]) == owner
