"""Plays the worker's part through the real store, so API tests control every event's timing."""

from __future__ import annotations

from store_helpers import StoreForTests

from common.schemas.events import DoneEvent, ErrorEvent, LogEntry
from common.schemas.requests import JobRequest
from common.schemas.views import JobStatus, Usage
from common.settings import Settings
from common.store import Append, Appended, Final, token_entry


class LogWriter:
    def __init__(self, settings: Settings) -> None:
        self.store = StoreForTests.from_settings(settings)
        self._attempt: dict[str, int] = {}
        self._seq: dict[str, int] = {}  # last seq written per job
        self._tokens: dict[str, int] = {}  # token events written per job

    def close(self) -> None:
        self.store.close()

    def running_job(self, prompt: str = "hello", background: bool = True) -> str:
        """A job created and taken, as a worker would; its log is empty."""
        request = {"prompt": prompt, "max_tokens": 64, "background": background}
        job = self.store.create_job(JobRequest.model_validate(request))
        taken = self.store.take_job(job.id, "test-writer", "test-model")
        self._attempt[job.id], self._seq[job.id], self._tokens[job.id] = taken.attempt, 0, 0
        return job.id

    def tokens(self, job_id: str, *texts: str) -> None:
        entries = []
        for text in texts:
            self._seq[job_id] += 1
            entries.append(token_entry(self._seq[job_id], self._tokens[job_id], text, [0]))
            self._tokens[job_id] += 1
        self._append(job_id, entries)

    def token_unpublished(self, job_id: str, text: str) -> None:
        """Append a token event to the log without publishing it: a publish lost on the way."""
        self._seq[job_id] += 1
        entry = token_entry(self._seq[job_id], self._tokens[job_id], text, [0])
        self._tokens[job_id] += 1
        self.store.redis.rpush(self.store.keys.job_log(job_id), entry.encode())

    def finish(self, job_id: str, finish_reason: str = "stop") -> None:
        n = self._tokens[job_id]
        done = DoneEvent(status=JobStatus.SUCCEEDED, finish_reason=finish_reason, usage=Usage.of(3, n))
        self._seq[job_id] += 1
        self._append(
            job_id, [LogEntry.done(self._seq[job_id], done)], Final(JobStatus.SUCCEEDED, finish_reason)
        )

    def fail(self, job_id: str, message: str = "boom") -> None:
        self._seq[job_id] += 1
        entry = LogEntry.error(self._seq[job_id], ErrorEvent(message=message, type="engine_error"))
        self._append(job_id, [entry], Final(JobStatus.FAILED, None))

    def _append(self, job_id: str, entries: list[LogEntry], final: Final | None = None) -> None:
        append = Append(job_id, self._attempt[job_id], entries, 3, self._tokens[job_id], final)
        assert self.store.append_batch([append]) == [Appended.WRITTEN]
