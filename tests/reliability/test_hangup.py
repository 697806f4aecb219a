"""A waiting request (a non-streamed OpenAI completion) whose client hangs up as soon as its job
runs: the API must stop watching the job and cancel it after the grace, every time.

`tests/test_openai_detach.py::test_waiting_request_whose_client_hangs_up_is_cancelled_after_the_grace`
failed about 1 run in 8: the job ran all its tokens. The cause was in the API: the cancel of the
wait's relay task, landing while that task was inside redis-py (subscribing the job's channel),
was swallowed; the wait never ended, so the request kept watching its job. Here the API plays
against no worker (this test takes the jobs and stands in for the worker's heartbeat), and the
client hangs up at once, which lost about a third of the cancels before the fix.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from procs import REDIS_URL, Prefixes, Service, start_api, wait_until

from common.schemas.events import DoneEvent, LogEntry
from common.schemas.views import JobStatus, Usage, WorkerHeartbeat
from common.settings import Settings
from common.store import Append, Final, SyncJobStore

GRACE_S = 0.3
TRIES = 12
CANCEL_WAIT_S = GRACE_S + 60.0  # the check runs at the grace; a bound for a stuck one, not a figure
MODEL = "hangup-model"


@pytest.fixture(scope="module")
def store(prefixes: Prefixes) -> Iterator[SyncJobStore]:
    s = SyncJobStore.from_settings(Settings(redis_url=REDIS_URL, redis_prefix=prefixes.new()))
    yield s
    s.close()


@pytest.fixture(scope="module")
def hangup_api(store: SyncJobStore, log_dir: Path) -> Iterator[Service]:
    api = start_api(store.settings.redis_prefix, log_dir, ready=False, detach_grace_s=GRACE_S)
    yield api
    api.stop()


def beat(store: SyncJobStore) -> None:
    """A live worker serving MODEL, as far as the API can tell."""
    store.beat(WorkerHeartbeat(name="stand-in", ts=time.time(), engine={}, model=MODEL, max_model_len=4096))


def submit_and_hang_up(api: Service, store: SyncJobStore) -> str:
    """Send a non-streamed completion, take its job as a worker would, and hang up at once."""
    host, port = api.url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1000, "temperature": 0}).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    queued = store.keys.queued_jobs(0)
    before = set(store.redis.zrange(queued, 0, -1))
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(head.encode() + body)
        new: set[str] = set()

        def queued_now() -> bool:
            new.update(set(store.redis.zrange(queued, 0, -1)) - before)
            return bool(new)

        wait_until(queued_now, "the job queued", 60)
        [job_id] = new
        store.take_job(job_id, "stand-in", MODEL)
    return str(job_id)


def test_a_client_that_hangs_up_at_once_gets_its_job_cancelled_every_time(
    store: SyncJobStore, hangup_api: Service, figures: dict[str, Any]
) -> None:
    for i in range(TRIES):
        beat(store)
        job_id = submit_and_hang_up(hangup_api, store)
        wait_until(
            lambda: store.redis.hget(store.keys.job(job_id), "cancel_requested") == "1",  # noqa: B023
            f"the cancel of job {i + 1} of {TRIES}, whose client left",
            CANCEL_WAIT_S,
        )
        # The stand-in worker ends the job (the API's relay of it ends with its terminal event).
        store.append_batch([cancelled_end(store, job_id)])
    figures["hangup_cancelled"] = f"{TRIES} of {TRIES} immediate hang-ups cancelled after the grace"


def cancelled_end(store: SyncJobStore, job_id: str) -> Append:
    done = DoneEvent(status=JobStatus.CANCELLED, finish_reason="cancelled", usage=Usage.of(1, 0))
    return Append(job_id, 1, [LogEntry.done(1, done)], 1, 0, Final(JobStatus.CANCELLED, "cancelled"))
