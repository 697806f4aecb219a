"""The hook worker's runtime: webhook deliveries on an asyncio loop of its own, liveness as any worker.

Celery task threads hand it a hooks hash (``deliver``) and return: the loop delivers that object's
deliveries in order through the store's lock (common/store/hooks.py), each attempt a POST signed as
Standard Webhooks to an address checked when it is resolved, for the connect (no redirects, a
bounded read of the answer, ``SPOOL_WEBHOOK_TIMEOUT_S``). A sweep on the same loop sends a
message for each hooks hash due. No torch, no model: ``spool worker --kind hooks``.

Fair: at most ``SPOOL_WEBHOOK_MAX_PER_HOST`` attempts in flight per destination (scheme, host,
port) and ``SPOOL_WEBHOOK_MAX_PER_KEY`` per API key. A delivery waits for its slots on the loop
(no thread) for at most ``SLOT_WAIT_S``, then is due again ``SLOT_WAIT_S`` later without an
attempt; no task thread ever waits for a receiver, so a hanging one delays no other destination.

What a receiver sees: docs/webhooks.md. The keys and scripts:
docs/internals.md#redis-names-from-commonkeyspy-only-prefix-spool_redis_prefix.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import httpx
from redis.exceptions import RedisError

from common.asyncio_tasks import cancel_until_done
from common.process import NamedThread
from common.schemas.views import batch_object
from common.settings import Settings
from common.store import AsyncBatchStore, AsyncJobStore, JobNotFound, SyncJobStore
from common.store.clients import async_data_client
from common.store.hooks import AsyncHookStore, Begun
from common.store.responses import RESPONSE_PREFIX
from common.webhooks import (
    BadDestination,
    RefusedAddress,
    envelope,
    host_allowed,
    host_port,
    owner_secrets,
    resolve_checked,
    retry_delay,
    signed_headers,
    trimmed_job,
)
from workers.hooks.metrics import HookMetrics
from workers.identity import this_process
from workers.liveness import HeldJob, Liveness

log = logging.getLogger(__name__)

MAX_ANSWER_BYTES = 64 * 1024  # of a receiver's answer body, read and dropped
SLOT_WAIT_S = 1.0  # the longest wait for slots; a delivery that gets none is due again this much later
T = TypeVar("T")
Send = Callable[[str], None]  # a hooks hash -> its message sent on {p}.hooks
Destination = tuple[str, str, int]  # a URL's scheme, host and port: what a slot is counted per


def destination(url: str) -> Destination:
    """Where a URL's deliveries go, as the in-flight caps count them: its scheme, host and port."""
    return (urlsplit(url).scheme, *host_port(url))


def claim_s(settings: Settings) -> float:
    """How long a worker holds an object's deliveries: an attempt, its render and its writes."""
    return 2 * settings.webhook_timeout_s + 5.0


class HookRuntime:
    def __init__(self, settings: Settings, name: str, send: Send) -> None:
        self.settings = settings
        self.name = name
        self.send = send
        self.token = f"{name}:{secrets.token_hex(4)}"  # the hooks hashes' lock holder
        self.metrics = HookMetrics()
        self._stop = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = NamedThread(target=self._loop.run_forever, name="spool-hooks-loop", daemon=True)
        self._slots: dict[Destination, asyncio.Semaphore] = {}  # per destination: attempts in flight
        self._key_slots: dict[str, asyncio.Semaphore] = {}  # per API key (owner): attempts in flight
        self._delivering: set[asyncio.Task[None]] = set()  # the loop's deliveries, one per hooks hash
        self._in_flight = 0
        self._delivered = 0
        self._me = asdict(this_process())  # the heartbeat's host, pid, pid_ns and instance
        store = SyncJobStore.from_settings(settings)
        self.liveness = Liveness(store, settings, name, self, self._stop, None, "")  # no jobs to sweep
        self._sweeper: asyncio.Task[None] | None = None

    @classmethod
    def start(cls, settings: Settings, name: str, send: Send) -> HookRuntime:
        runtime = cls(settings, name, send)
        runtime._thread.start()
        runtime._run(runtime._open())
        if settings.worker_metrics_port is not None:
            runtime.metrics.serve(settings.worker_metrics_port)
        runtime.liveness.start()
        runtime._sweeper = runtime._run(runtime._start_sweep())
        return runtime

    async def _start_sweep(self) -> asyncio.Task[None]:
        return asyncio.create_task(self._sweep())

    async def _open(self) -> None:
        client = async_data_client(self.settings.redis_url)
        self.hooks = AsyncHookStore(client, self.settings)
        self.jobs = AsyncJobStore(client, self.settings)
        self.batches = AsyncBatchStore(client, self.settings)
        # NOTE: no environment proxies: the checked address must be the one connected to.
        self.http = httpx.AsyncClient(
            follow_redirects=False, trust_env=False, timeout=self.settings.webhook_timeout_s
        )

    def close(self) -> None:
        self._stop.set()
        self.liveness.join(timeout=10)
        self._run(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _close(self) -> None:
        if self._sweeper is not None:  # before its clients close under it
            await cancel_until_done([self._sweeper])
        # Deliveries cut here stay locked until their claims end; then another worker sends them.
        await cancel_until_done(list(self._delivering))
        await self.http.aclose()
        await self.hooks.redis.aclose()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    # -- the executor of workers/liveness.py: it holds no job ------------------------------------

    def held(self) -> dict[str, HeldJob]:
        return {}

    def abort(self, job_id: str) -> None:
        pass

    def heartbeat_fields(self) -> dict[str, Any]:
        engine = {"running": self._in_flight, "delivered": self._delivered}
        return {"engine": engine, "model": "", "kind": "hooks", **self._me}

    # -- the sweep and the task ------------------------------------------------------------------

    async def _sweep(self) -> None:
        """Send a message for each hooks hash due (each claimed by the store for a claim's time)."""
        while not self._stop.is_set():
            try:
                for key in await self.hooks.due(time.time(), claim_s(self.settings)):
                    await asyncio.to_thread(self.send, key)
            except (RedisError, OSError) as e:  # the claims lapse; the next sweep sends them
                log.warning("webhook sweep failed: %s", e)
            except Exception:
                log.exception("webhook sweep failed")
            await asyncio.sleep(self.settings.webhook_sweep_s)

    def deliver(self, key: str) -> None:
        """A task thread's: start delivering this hooks hash's deliveries due, in order, on the
        loop, and return at once (the thread never waits for a receiver or a slot)."""
        self._run(self._start_delivery(key))

    async def _start_delivery(self, key: str) -> None:
        task = asyncio.create_task(self._deliver(key))
        self._delivering.add(task)
        task.add_done_callback(self._delivering.discard)

    async def _deliver(self, key: str) -> None:
        """Its hash's deliveries due, in order. A failure leaves the hash locked until its claim
        ends, and due: a sweep then sends it again."""
        try:
            while not self._stop.is_set():
                begun = await self.hooks.begin(key, self.token, time.time(), claim_s(self.settings))
                if begun is None or not await self._attempt(begun):
                    return
        except (RedisError, OSError) as e:
            log.warning("webhook delivery of %s failed: %s", key, e)
        except Exception:
            log.exception("webhook delivery of %s failed", key)

    async def _take_slots(self, url: str, owner: str) -> list[asyncio.Semaphore] | None:
        """The slots of an attempt to ``url`` for ``owner`` (its destination's and its key's),
        waited for on the loop for at most SLOT_WAIT_S in all; None: not within that time."""
        settings = self.settings
        wanted = [
            self._key_slots.setdefault(owner, asyncio.Semaphore(settings.webhook_max_per_key)),
            self._slots.setdefault(destination(url), asyncio.Semaphore(settings.webhook_max_per_host)),
        ]
        taken: list[asyncio.Semaphore] = []
        try:
            async with asyncio.timeout(SLOT_WAIT_S):
                for slots in wanted:
                    await slots.acquire()
                    taken.append(slots)
        except TimeoutError:
            for slots in taken:
                slots.release()
            return None
        return taken

    async def _attempt(self, begun: Begun) -> bool:
        """One attempt of the delivery; True when it is done (the next one may go)."""
        record, hook = dict(begun.record), begun.hook
        url, owner = record["url"], hook["owner"]
        now = time.time()
        if await self.hooks.is_disabled(owner, url):
            record.update(status="disabled", next_attempt_at=None)
            self.metrics.outcome("disabled")
            return await self.hooks.record(self.token, begun, record, None, now)
        taken = await self._take_slots(url, owner)
        if taken is None:  # its destination or key has enough in flight: due again soon, no attempt
            later = time.time()
            await self.hooks.record(self.token, begun, record, later + SLOT_WAIT_S, later)
            return False
        self._in_flight += 1
        refused = False
        try:
            body = begun.body or await self._render(begun)
            try:
                code, error, took = await self._post(url, body, await self._secrets(owner), record["id"])
            except RefusedAddress as e:  # the address guard's: no later attempt would pass it
                code, error, took, refused = None, str(e), 0.0, True
        finally:
            self._in_flight -= 1
            for slots in taken:
                slots.release()
        if not refused:  # no request was made
            self.metrics.attempt_time.observe(took)
        attempts = [*record.get("attempts", []), {"at": now, "status_code": code, "error": error}]
        record.update(attempts=attempts, next_attempt_at=None)
        retry_at: float | None = None
        if code is not None and 200 <= code < 300:
            record["status"], outcome = "delivered", "delivered"
            self._delivered += 1
        elif code == 410:
            await self.hooks.disable(owner, url)
            record["status"], outcome = "disabled", "disabled"
        elif refused:  # a permanent failure, recorded with the guard's reason
            record["status"], outcome = "failed", "failed"
        else:
            wait = retry_delay(len(attempts), self.settings.webhook_backoff_s)
            if now + wait > record["created_at"] + self.settings.webhook_horizon_s:
                record["status"], outcome = "failed", "failed"
            else:
                retry_at = record["next_attempt_at"] = attempts[-1]["next_attempt_at"] = now + wait
                outcome = "retried"
        self.metrics.outcome(outcome)
        written = await self.hooks.record(self.token, begun, record, retry_at, time.time())
        return written and retry_at is None

    async def _secrets(self, owner: str) -> list[str]:
        return owner_secrets(await self.hooks.server_secrets(), owner)

    async def _render(self, begun: Begun) -> bytes:
        """The envelope of a delivery's first attempt, with its object as GET shows it now;
        stored, so every retry sends the same bytes."""
        kind, object_id, record = begun.hook["kind"], begun.hook["id"], begun.record
        data: dict[str, Any]
        if begun.hook.get("events_of") == "response":  # OpenAI's webhook data for a response: its id
            data = {"id": RESPONSE_PREFIX + object_id}
        elif kind == "batch":
            h = await self.batches.get_batch(object_id)
            data = batch_object(h) if h else {"id": object_id, "object": "batch"}
        else:
            try:
                job = (await self.jobs.get_record(object_id)).job.model_dump(mode="json")
            except JobNotFound:  # expired before its first attempt
                job = {"id": object_id}
            data = trimmed_job(
                {**job, "object": "job"}, f"/v1/jobs/{object_id}", self.settings.webhook_max_bytes
            )
        if record.get("part") is not None:
            data = {**data, "part": record["part"]}
        body = envelope(record["id"], record["type"], record["created_at"], data)
        await self.hooks.put_body(begun.key, begun.n, body)
        return body

    async def _post(
        self, url: str, body: bytes, keys: list[str], msg_id: str
    ) -> tuple[int | None, str | None, float]:
        """(status code or None, error or None, seconds) of one POST: to an address of the host
        checked as it is resolved now (DNS rebinding), with the URL's host in Host and TLS's SNI."""
        started = time.perf_counter()
        parts = urlsplit(url)
        host, port = host_port(url)
        allowed = host_allowed(
            host, self.settings.webhook_allow_private, self.settings.webhook_allow_host_set
        )
        try:
            async with asyncio.timeout(self.settings.webhook_timeout_s):
                address = (await resolve_checked(host, port, allowed))[0]
                netloc = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
                target = urlunsplit((parts.scheme, netloc, parts.path or "/", parts.query, ""))
                headers = {**signed_headers(keys, msg_id, body), "host": parts.netloc}
                request = self.http.build_request("POST", target, content=body, headers=headers)
                if parts.scheme == "https":
                    request.extensions["sni_hostname"] = host
                response = await self.http.send(request, stream=True)
                try:
                    read = 0
                    async for chunk in response.aiter_raw():
                        read += len(chunk)
                        if read >= MAX_ANSWER_BYTES:
                            break
                finally:
                    await response.aclose()
                return response.status_code, None, time.perf_counter() - started
        except RefusedAddress:
            raise  # _attempt's: a permanent failure
        except BadDestination as e:  # the host does not resolve (now): retried
            return None, str(e), time.perf_counter() - started
        except TimeoutError:
            return (
                None,
                f"no answer within {self.settings.webhook_timeout_s:g} s",
                time.perf_counter() - started,
            )
        except httpx.HTTPError as e:
            return None, f"{type(e).__name__}: {e}", time.perf_counter() - started
