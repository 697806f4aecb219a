"""The web console: static files from api/console/, and the cluster figures its page polls."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import FileResponse, HTMLResponse

from api.deps import StoreDep
from api.errors import ApiError
from api.served import queued_models

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
async def console_status(store: StoreDep) -> dict[str, Any]:
    """What the console shows about the cluster: live workers with their kind (text, media) and
    engine figures (a text worker's engine stats; a media worker's part and step), and the queue
    depths. Public like /readyz; a 503 envelope when Redis is unreachable."""
    workers = await store.list_workers()
    return {
        "workers": [
            {"name": w.name, "model": w.model, "kind": w.kind, "ts": w.ts, "engine": w.engine}
            for w in workers
        ],
        "queued_jobs": await store.queued_count(),
        "queues": dict(await store.queue_depths(queued_models(workers, store.settings))),
    }
