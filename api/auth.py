"""Optional API keys (``SPOOL_API_KEYS``): who may call, and whose jobs they may see.

Without keys configured nothing is checked and every job's owner is empty. With keys, every
``/v1`` request needs ``Authorization: Bearer KEY`` (else 401); a job stores the hash of the key
that created it, and a request for a job under ``/v1/jobs/{id}`` made with another key gets the
same 404 as an unknown id, so ids cannot be probed across keys. Probes, metrics and the schema
(``/healthz``, ``/readyz``, ``/metrics``, ``/docs``, ``/openapi.json``) stay open.

The contract: docs/internals.md#api-process-api.
"""

from __future__ import annotations

import hashlib
import re
from contextvars import ContextVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import ApiError, error_body
from common.settings import Settings
from common.tenants import tenant_of

_owner: ContextVar[str] = ContextVar("spool_owner", default="")
_JOB_PATH = re.compile(r"^/v1/jobs/([^/]+)")


def owner_of(key: str) -> str:
    """What a job stores about the key that created it: never the key itself."""
    return hashlib.sha256(key.encode()).hexdigest()


def bearer_owner(headers: Headers) -> str:
    """The owner of the request's ``Authorization: Bearer KEY`` (empty without one)."""
    scheme, _, key = headers.get("authorization", "").partition(" ")
    return owner_of(key.strip()) if scheme.lower() == "bearer" else ""


def current_owner() -> str:
    """The owner of the request being served (empty without API keys)."""
    return _owner.get()


def check_priority(settings: Settings, owner: str, priority: int) -> None:
    """403 for a priority below what the owner's key may ask for: a request's, or a batch line's
    (the same refusal either way)."""
    if priority < (floor := settings.priority_floor_of(tenant_of(owner))):
        raise ApiError(
            403,
            f"priority {priority} is below what this API key may ask for ({floor}; "
            "SPOOL_PRIORITY_FLOOR, SPOOL_TENANT_PRIORITY_FLOORS)",
            param="priority",
            code="priority_not_allowed",
        )


class AuthMiddleware:
    def __init__(self, app: ASGIApp, keys: frozenset[str]) -> None:
        self.app = app
        self.owners = frozenset(owner_of(k) for k in keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.owners or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        owner = bearer_owner(Headers(scope=scope))
        if owner not in self.owners:
            message = "Missing or invalid API key; send 'Authorization: Bearer KEY'"
            body = error_body(401, message, code="invalid_api_key")
            await JSONResponse(body, 401, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        match = _JOB_PATH.match(scope["path"])
        job_id = match.group(1) if match else None
        try:
            hidden = job_id is not None and not await self._may_see(scope, job_id, owner)
        except (RedisConnectionError, RedisTimeoutError) as e:
            message = f"Service unavailable: Redis is unreachable ({e})"
            await JSONResponse(error_body(503, message, code="backend_unavailable"), 503)(
                scope, receive, send
            )
            return
        if hidden:
            message = f"No job with id {job_id!r} (unknown, or expired)"
            await JSONResponse(error_body(404, message, "job_id", "job_not_found"), 404)(scope, receive, send)
            return
        token = _owner.set(owner)
        try:
            await self.app(scope, receive, send)
        finally:
            _owner.reset(token)

    @staticmethod
    async def _may_see(scope: Scope, job_id: str, owner: str) -> bool:
        stored = await scope["app"].state.services.store.owner(job_id)
        return stored is None or stored == owner  # unknown ids go on to the route's own 404
