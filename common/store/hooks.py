"""Webhook deliveries in Redis. The script that records an event records its delivery, the hook
workers (workers/hooks/) deliver it, and the API lists and retries them.

An object with a webhook (a job, a batch) holds a ``hook`` field that says where its deliveries go.
The script that writes one of its events appends the delivery to the object's hooks hash and puts
that hash in the due set, so an event is never seen without its delivery. A hook worker's sweep
claims the due hashes and sends each a Celery message, and the task delivers the hash's next
delivery under its lock. Deliveries of an object go one at a time, in order. A worker that dies
leaves the hash due at the end of its claim, so at most that one delivery goes twice.

The keys and scripts: docs/internals.md#redis-names-from-commonkeyspy-only-prefix-spool_redis_prefix
("Webhooks"). What a receiver sees: docs/webhooks.md.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aredis

from common.keys import Keys
from common.settings import Settings
from common.store.scripts import source
from common.webhooks import BATCH_EVENTS, DEFAULT_EVENTS, MAX_ENDPOINTS, check_secret, new_secret

STATUSES = ("pending", "delivered", "failed", "disabled")  # a delivery's; failed: given up


def hook_field(
    keys: Keys,
    settings: Settings,
    kind: str,
    object_id: str,
    url: str | None,
    events: list[str] | None,
    owner: str,
    events_of: str = "job",
    endpoints: Sequence[dict[str, Any]] = (),
) -> str:
    """The ``hook`` field of an object with a webhook: what hook_event.lua needs to record its deliveries.
    ``url`` and ``events``: its own webhook, if any, and the events sent (default: a job's
    completed, every end of a batch); ``endpoints``: its owner's server-wide ones (each with its
    url and events); ``events_of`` "response": a job's end is sent as a response's
    (response.completed, ...)."""
    chosen = list(events or (BATCH_EVENTS if kind == "batch" else DEFAULT_EVENTS))
    targets = [{"url": url, "events": chosen}] if url is not None else []
    targets += [{"url": e["url"], "events": e["events"]} for e in endpoints]
    ttl = int(
        settings.webhook_horizon_s + max(settings.job_ttl_s, settings.file_ttl_s if kind == "batch" else 0)
    )
    return json.dumps(
        {
            "key": keys.hooks(kind, object_id),
            "due": keys.hooks_due(keys.bucket_of(object_id)),
            "kind": kind,
            "id": object_id,
            "targets": targets,
            "owner": owner,
            "ttl": ttl,
            "events_of": events_of,
        }
    )


@dataclass(frozen=True)
class Begun:
    """A delivery its worker holds the lock for."""

    key: str  # the hooks hash
    n: int  # its number in the object's deliveries, from 1
    record: dict[str, Any]  # id, type, created_at, url, status, attempts, part, ...
    body: bytes | None  # the envelope, once rendered (its first attempt)
    hook: dict[str, Any]  # the object's hook field: kind, id, owner, ...


def delivery_view(record: dict[str, Any]) -> dict[str, Any]:
    """A delivery as ``GET .../webhooks`` lists it."""
    return {
        "id": f"whd_{record['n']}",
        "object": "webhook.delivery",
        "event_id": record["id"],
        "type": record["type"],
        "url": record["url"],
        "status": record["status"],
        "created_at": record["created_at"],
        "attempts": record.get("attempts", []),
        "next_attempt_at": record.get("next_attempt_at"),
        **({"retry_of": f"whd_{record['retry_of']}"} if record.get("retry_of") else {}),
    }


class AsyncHookStore:
    """Webhook deliveries, over redis.asyncio: the API's listing and retries, the hook workers'
    sweep and deliveries."""

    def __init__(self, client: aredis.Redis, settings: Settings) -> None:
        self.settings = settings
        self.keys = settings.keys
        self.redis = client
        self._due = client.register_script(source("hook_due"))
        self._begin = client.register_script(source("hook_begin"))
        self._attempt = client.register_script(source("hook_attempt"))
        self._retry = client.register_script(source("hook_retry"))

    async def server_secrets(self) -> list[str]:
        """SPOOL_WEBHOOK_SECRET's secrets, else the one generated on first use and kept in Redis."""
        given = [s.strip() for s in self.settings.webhook_secret.split(",") if s.strip()]
        if given:
            return given
        key = self.keys.hooks_secret()
        await self.redis.set(key, new_secret(), nx=True)
        secret = str(await self.redis.get(key))
        check_secret(secret)
        return [secret]

    async def due(self, now: float, claim_s: float, limit: int = 100) -> list[str]:
        """The hooks keys with a delivery due, claimed for ``claim_s`` (hook_due.lua), of every bucket."""
        keys: list[str] = []
        for b in self.keys.bucket_range():
            if len(keys) < limit:
                keys += map(
                    str,
                    await self._due([self.keys.hooks_due(b)], [repr(now), repr(claim_s), limit - len(keys)]),
                )
        return keys

    async def backlog(self) -> int:
        """Objects with a delivery pending."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for b in self.keys.bucket_range():
                pipe.zcard(self.keys.hooks_due(b))
            return sum(await pipe.execute())

    async def begin(self, key: str, token: str, now: float, claim_s: float) -> Begun | None:
        reply = await self._begin([key, self.keys.hooks_due_of(key)], [token, repr(now), repr(claim_s)])
        if not reply:
            return None
        n, record, body, hook = reply
        return Begun(key, int(n), json.loads(record), str(body).encode() if body else None, json.loads(hook))

    async def put_body(self, key: str, n: int, body: bytes) -> None:
        """A delivery's envelope, rendered at its first attempt: every retry sends these bytes."""
        await self.redis.hsetnx(key, f"b{n}", body.decode())

    async def record(
        self, token: str, begun: Begun, record: dict[str, Any], retry_at: float | None, now: float
    ) -> bool:
        """An attempt's outcome (``retry_at``: when to try again; None: done); False when the lock
        was no longer this worker's (its claim ended: another worker has the delivery)."""
        outcome, at = ("retry", retry_at) if retry_at is not None else ("done", now)
        args: list[str | int] = [token, begun.n, json.dumps(record), outcome, repr(at), repr(now)]
        return bool(await self._attempt([begun.key, self.keys.hooks_due_of(begun.key)], args))

    async def is_disabled(self, owner: str, url: str) -> bool:
        return bool(await self.redis.sismember(self.keys.hooks_disabled(owner), url))

    async def disable(self, owner: str, url: str) -> None:
        await self.redis.sadd(self.keys.hooks_disabled(owner), url)

    async def endpoints(self, owner: str) -> list[dict[str, Any]]:
        """The owner's server-wide endpoints, oldest first."""
        raw = await self.redis.hvals(self.keys.hooks_endpoints(owner))
        return sorted((json.loads(v) for v in raw), key=lambda e: (e["created_at"], e["id"]))

    async def add_endpoint(self, owner: str, url: str, events: list[str]) -> dict[str, Any] | None:
        """A new endpoint (None when the owner has MAX_ENDPOINTS already)."""
        key = self.keys.hooks_endpoints(owner)
        endpoint_id = "whe_" + secrets.token_hex(12)
        endpoint: dict[str, Any] = {
            "id": endpoint_id,
            "object": "webhook_endpoint",
            "url": url,
            "events": events,
            "created_at": int(time.time()),
        }
        # NOTE: two concurrent adds may pass the count together: at most one over, no harm.
        if await self.redis.hlen(key) >= MAX_ENDPOINTS:
            return None
        await self.redis.hset(key, endpoint_id, json.dumps(endpoint))
        return endpoint

    async def delete_endpoint(self, owner: str, endpoint_id: str) -> bool:
        return bool(await self.redis.hdel(self.keys.hooks_endpoints(owner), endpoint_id))

    async def deliveries(self, kind: str, object_id: str) -> list[dict[str, Any]]:
        """An object's deliveries, oldest first, as ``delivery_view`` shows them."""
        h = await self.redis.hgetall(self.keys.hooks(kind, object_id))
        records = [json.loads(v) for k, v in h.items() if str(k).startswith("d")]
        return [delivery_view(r) for r in sorted(records, key=lambda r: int(r["n"]))]

    async def retry(self, kind: str, object_id: str, n: int, owner: str) -> dict[str, Any] | None:
        """Deliver delivery ``n`` again (its URL enabled again if a 410 disabled it); the new
        delivery, or None when there is no delivery ``n``."""
        key = self.keys.hooks(kind, object_id)
        raw = await self.redis.hget(key, f"d{n}")
        if raw is None:
            return None
        await self.redis.srem(self.keys.hooks_disabled(owner), json.loads(raw)["url"])
        m = int(await self._retry([key, self.keys.hooks_due_of(key)], [n, repr(time.time())]))
        return delivery_view(json.loads(str(await self.redis.hget(key, f"d{m}"))))
