"""Request body size limit, answered with the error envelope.

FastAPI's own ``max_body_size`` answers a declared-too-large body with a plain-text 413 from
outside the exception handlers, so the envelope would be lost; this middleware sits inside.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_body


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, exempt: tuple[str, ...] = ()) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.exempt = exempt  # paths whose routes limit their bodies themselves

    def _too_large(self) -> str:
        return f"Request body is larger than {self.max_bytes} bytes (SPOOL_MAX_BODY_BYTES)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt:
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            # Refuse before reading a byte of it.
            response = JSONResponse(error_body(413, self._too_large(), code="body_too_large"), 413)
            await response(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            # A chunked body declares no length: count what arrives. HTTPException is the one
            # error FastAPI lets out of body parsing unchanged, so the handlers render it.
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, self._too_large())
            return message

        await self.app(scope, counted, send)
