"""The errors the store raises on purpose (the API maps them to 404, 409 and 429: api/errors.py)."""

from __future__ import annotations


class StoreError(RuntimeError):
    """Base of the errors the store raises on purpose."""


class JobNotFound(StoreError):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"job {job_id!r} not found")
        self.job_id = job_id


class Conflict(StoreError):
    """The job is in a state that does not allow the operation (e.g. cancelling a finished job)."""


class IdempotencyConflict(Conflict):
    def __init__(self, job_id: str) -> None:
        super().__init__(f"this Idempotency-Key created job {job_id} with a different request")
        self.job_id = job_id


class QueueFull(StoreError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the queue is full ({limit} jobs queued); retry later")
        self.limit = limit


class KeyQueueFull(QueueFull):
    """The owner (API key) has as many jobs queued as it may; the others' room is theirs."""

    def __init__(self, limit: int) -> None:
        StoreError.__init__(
            self,
            f"this API key has {limit} jobs queued, the most it may (SPOOL_MAX_QUEUED_JOBS_PER_KEY, "
            "SPOOL_TENANT_MAX_QUEUED_JOBS); retry later",
        )
        self.limit = limit
