"""The API's store operations over the worker's synchronous client, for tests and tools that play
the API's part without an event loop: the twins of ``AsyncJobStore``'s, the same Lua scripts and
builders, so the store (common/store/) stays the only code that defines a Redis write."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import redis

from common.schemas.events import LogEntry
from common.schemas.requests import JobRequest
from common.schemas.views import Job, WorkerHeartbeat
from common.settings import Settings, load_settings
from common.store import (
    JobNotFound,
    JobRecord,
    MessageFor,
    SyncJobStore,
    cancel_args,
    check_cancel,
    check_created,
    check_replay,
    create_call,
    decode_log,
    heartbeats_from,
    job_text,
    record_from_hash,
    record_reads,
    text_read,
    with_log_tail,
    worker_keys,
)
from common.store.scripts import source


class StoreForTests(SyncJobStore):
    """``SyncJobStore`` plus the API's create, read and cancel."""

    def __init__(self, client: redis.Redis, settings: Settings, broker: redis.Redis | None = None) -> None:
        super().__init__(client, settings, broker)
        self._create = client.register_script(source("create"))
        self._cancel = client.register_script(source("cancel"))

    def create_job(
        self,
        request: JobRequest,
        owner: str = "",
        message_for: MessageFor | None = None,
        idempotency_key: str | None = None,
    ) -> Job:
        fields, (keys, args) = create_call(
            self.keys, self.settings, request, owner, message_for, idempotency_key
        )
        earlier = check_created(self._create(keys, args), self.settings.max_queued_jobs)
        if earlier is not None:
            return check_replay(self.get_record(earlier), request)
        self.relay()
        return record_from_hash(fields, "").job

    def get_record(self, job_id: str) -> JobRecord:
        pipe = self.redis.pipeline(transaction=False)  # see record_reads
        h, text, logged = record_reads(pipe, self.keys, job_id).execute()
        if not h:
            raise JobNotFound(job_id)
        if (read := text_read(h, text, logged)) is None:  # cancelled while queued, or its text key lost
            return record_from_hash(h, job_text(self.read_log(job_id)))
        record = record_from_hash(h, read[0])
        return with_log_tail(record, self.read_log(job_id, after=read[1])) if read[1] else record

    def get_job(self, job_id: str) -> Job:
        return self.get_record(job_id).job

    def read_log(self, job_id: str, after: int = 0) -> list[LogEntry]:
        return decode_log(self.redis.lrange(self.keys.job_log(job_id), after, -1))

    def request_cancel(self, job_id: str) -> Job:
        keys, args = cancel_args(self.keys, job_id, self.settings.job_ttl_s)
        check_cancel(self._cancel(keys, args), job_id)
        return self.get_job(job_id)

    def list_workers(self) -> list[WorkerHeartbeat]:
        names = [str(n) for n in self.redis.zrange(self.keys.workers(), 0, -1)]
        return heartbeats_from(self.redis.mget(worker_keys(self.keys, names))) if names else []


def every_bucket(r: redis.Redis, names: list[str]) -> list[str]:
    """The members of these sorted sets (one per bucket: ``[keys.held_media(b) for b in
    keys.bucket_range()]``), together by score."""
    scored = [(score, str(m)) for name in names for m, score in r.zrange(name, 0, -1, withscores=True)]
    return [m for _, m in sorted(scored)]


def store_on(redis_url: str, prefix: str, model: Path) -> Iterator[StoreForTests]:
    """For a module's fixture: a store on ``prefix`` whose settings name ``model`` (so its queue is
    that model's, as a worker's of it), closed at the end."""
    store = StoreForTests.from_settings(
        load_settings(redis_url=redis_url, redis_prefix=prefix, model=str(model))
    )
    yield store
    store.close()
