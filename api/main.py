"""The Spool API: ``uvicorn api.main:app`` (or ``spool api``)."""

from __future__ import annotations

from fastapi import FastAPI

from api.auth import AuthMiddleware
from api.errors import install_error_handlers
from api.limits import BodyLimitMiddleware
from api.routes import batches, files, health, jobs, openai
from api.services import lifespan
from common.settings import Settings, get_settings


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    app = FastAPI(title="Spool", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    install_error_handlers(app)
    # An upload has its own limit, counted as it streams in (api/uploads.py).
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, exempt=("/v1/files",))
    app.add_middleware(AuthMiddleware, keys=settings.api_key_set)  # outermost: 401 before the body is read
    app.include_router(jobs.router)
    app.include_router(health.router)
    app.include_router(openai.router)
    app.include_router(files.router)
    app.include_router(batches.router)
    return app


app = create_app()
