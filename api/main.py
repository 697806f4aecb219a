"""The Spool API: ``uvicorn api.main:app`` (or ``spool api``)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi_offline import FastAPIOffline

from api.auth import AuthMiddleware
from api.errors import install_error_handlers
from api.http_limits import BodyLimitMiddleware
from api.metrics import RequestMetricsMiddleware
from api.routes import batches, console, embeddings, files, health, jobs, openai, responses, webhooks
from api.services import lifespan
from common.settings import Settings, check_api_settings, get_settings

DOCS_ASSETS = "/docs-assets"  # Swagger UI's and ReDoc's files, served from the fastapi-offline package


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    check_api_settings(settings)
    # NOTE: FastAPI's own /docs and /redoc load their scripts from a CDN, so they render blank on
    # a machine without internet; these serve the same pages with the files from the package.
    app = FastAPIOffline(
        title="Spool",
        version="0.1.0",
        lifespan=lifespan,
        static_url=DOCS_ASSETS,
        # The online validator's badge would be fetched from validator.swagger.io.
        swagger_ui_parameters={"validatorUrl": None},
    )
    app.state.settings = settings
    install_error_handlers(app)
    # An upload has its own limit, counted as it streams in (api/uploads.py).
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, exempt=("/v1/files",))
    app.add_middleware(AuthMiddleware, keys=settings.api_key_set)  # 401 before the body is read
    if settings.cors_origin_list:  # outside the keys' check: a preflight carries no Authorization
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origin_list,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "Last-Event-ID", "Idempotency-Key"],
            expose_headers=["Location", "X-Spool-Ready"],
        )
    app.add_middleware(RequestMetricsMiddleware)  # outermost: every answer counts, a 401 too
    app.include_router(jobs.router)
    app.include_router(health.router)
    app.include_router(openai.router)
    app.include_router(embeddings.router)
    app.include_router(responses.router)
    app.include_router(console.router)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(webhooks.router)
    return app


app = create_app()
