"""Limits on what a client may make the API process read: the request head, the time it takes to
send it, the number of connections and the size of the body.

uvicorn reads any request head (a 100 MB header took 13 s and 276 MB of memory, before
authentication), waits forever for a head or a body that trickles in, and takes any number of
connections. ``spool api`` therefore runs uvicorn's httptools protocol with these limits:

- ``SPOOL_MAX_HEADER_BYTES``: a request head (request line and headers) larger than this is
  answered 431 and the connection closed, as soon as that many bytes arrived.
- ``SPOOL_HEADER_TIMEOUT_S``: a connection that has not sent a whole head this long after it
  opened (or, on a keep-alive connection, after its head began) is answered 408 and closed.
- ``SPOOL_BODY_TIMEOUT_S``: a request body not received in full this long after its head is
  answered 408 (or, once the app has begun answering, cut).
- ``SPOOL_MAX_CONNECTIONS``: a connection past this many open ones is answered 503 and closed.

These act before the app sees a request. The body's size, ``SPOOL_MAX_BODY_BYTES``, is checked
inside the app instead, by ``BodyLimitMiddleware`` (a 413 with the error envelope). FastAPI's own
``max_body_size`` answers a declared-too-large body with a plain-text 413 from outside the
exception handlers, so the envelope would be lost.

Nothing limits how long a response takes: an SSE stream, or a request waiting for its job,
has sent its whole request and is only being written to.

What each refusal looks like, with its test: docs/reliability.md, section 12.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from api.errors import error_body
from common.settings import Settings


class HeadTooLarge(Exception):
    """Raised in a parser callback: a request head past SPOOL_MAX_HEADER_BYTES."""


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int

    @classmethod
    def of(cls, settings: Settings) -> HttpLimits:
        return cls(
            settings.max_header_bytes,
            settings.header_timeout_s,
            settings.body_timeout_s,
            settings.max_connections,
        )


def refusal(status: int, message: str, code: str) -> bytes:
    """A whole HTTP response with the error envelope, after which the connection closes."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with ``limits`` (set on a subclass: see ``protocol_class``)."""

    limits: HttpLimits

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_bytes = 0
        self._in_head = True  # no request head parsed yet since the last request ended
        self._parsed_head = 0  # the bytes of the head being parsed, as the parser hands them over
        self._deadline: asyncio.TimerHandle | None = None

    # -- uvicorn's protocol hooks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        over = len(self.connections) >= self.limits.max_connections
        super().connection_made(transport)
        if over:
            message = f"Too many connections (SPOOL_MAX_CONNECTIONS={self.limits.max_connections})"
            self._refuse(503, message, "too_many_connections")
            return
        self._arm(self.limits.header_timeout_s, self._head_too_slow)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._head_bytes += len(data)
            if self._deadline is None:  # a keep-alive connection's next request begins
                self._arm(self.limits.header_timeout_s, self._head_too_slow)
        super().data_received(data)
        too_large = self._in_head and self._head_bytes > self.limits.max_header_bytes
        if too_large and not self.transport.is_closing():
            # NOTE: checked per read, before the parser has buffered more than one read (64 KiB)
            # beyond the limit: httptools keeps a header value whole until it ends.
            self._refuse_head()

    # NOTE: the count per read above misses a head that arrives whole in one read (up to about
    # 128 KiB passed): the parser completes it within that read. These count what it parses.
    def on_message_begin(self) -> None:
        self._parsed_head = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)  # with ": " and CRLF
        super().on_header(name, value)

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to a parse stopped by a callback: _count_head's, or a malformed head.
        if self._parsed_head > self.limits.max_header_bytes:
            self._refuse_head()
        else:
            super().send_400_response(msg)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._disarm()
        super().on_headers_complete()
        if self.cycle is not None and self.cycle.more_body:
            self._arm(self.limits.body_timeout_s, self._body_too_slow)

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_head = True
        super().on_message_complete()

    # NOTE: an answer sent before the whole body arrived (413, 401) leaves the body's deadline
    # armed: uvicorn's keep-alive timeout restarts with every read, so a body trickling in
    # after its answer would hold the connection for good.

    # -- the limits ------------------------------------------------------------------------------

    def _arm(self, seconds: float, then: Any) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, then)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _count_head(self, n: int) -> None:
        self._parsed_head += n
        if self._parsed_head > self.limits.max_header_bytes:
            raise HeadTooLarge  # stops the parser, and uvicorn calls send_400_response

    def _refuse_head(self) -> None:
        limit = self.limits.max_header_bytes
        message = f"Request head is larger than {limit} bytes (SPOOL_MAX_HEADER_BYTES)"
        self._refuse(431, message, "headers_too_large")

    def _head_too_slow(self) -> None:
        self._deadline = None
        limit = self.limits.header_timeout_s
        message = f"Request head not received within {limit:g}s (SPOOL_HEADER_TIMEOUT_S)"
        self._refuse(408, message, "request_timeout")

    def _body_too_slow(self) -> None:
        self._deadline = None
        limit = self.limits.body_timeout_s
        message = f"Request body not received within {limit:g}s (SPOOL_BODY_TIMEOUT_S)"
        self._refuse(408, message, "request_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` and close, or only close once the app has begun its answer."""
        if self.transport.is_closing():
            return
        cycle = self.cycle  # on a keep-alive connection, the last request's while a head comes in
        if cycle is None or not cycle.response_started or cycle.response_complete:
            self.transport.write(refusal(status, message, code))
        if self.cycle is not None:
            self.cycle.disconnected = True  # the app's reads see a disconnect, its writes are dropped
            self.cycle.message_event.set()
        self.transport.close()


def protocol_class(limits: HttpLimits) -> type[LimitedHttpToolsProtocol]:
    """The protocol class for uvicorn's ``http`` option (uvicorn builds it with its own arguments)."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})


class BodyLimitMiddleware:
    """SPOOL_MAX_BODY_BYTES, answered with the error envelope (a middleware inside the app)."""

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
