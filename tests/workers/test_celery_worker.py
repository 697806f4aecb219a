"""The real `spool worker` process (the session's cluster), driven through Celery by task name."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery
from procs import REDIS_URL, Prefixes, Service, worker_alone
from store_helpers import StoreForTests, store_on

from common.keys import GENERATE_TASK
from common.schemas.requests import JobRequest
from common.schemas.views import Job, JobStatus
from common.settings import load_settings
from workers.celery_app import make_app

LONG_PROMPT = "the quick brown fox"  # greedy on the tiny model runs to max_tokens (no EOS)


@pytest.fixture(scope="module")
def worker(prefixes: Prefixes, tiny_model: Path, log_dir: Path) -> Iterator[tuple[str, Service]]:
    yield from worker_alone(prefixes, tiny_model, log_dir, slots=8)


@pytest.fixture(scope="module")
def store(worker: tuple[str, Service], tiny_model: Path) -> Iterator[StoreForTests]:
    yield from store_on(REDIS_URL, worker[0], tiny_model)


@pytest.fixture(scope="module")
def celery_app(store: StoreForTests) -> Celery:
    return make_app(store.settings)


def finished(store: StoreForTests, job_id: str, timeout: float = 60.0) -> Job:
    deadline = time.monotonic() + timeout
    while not (job := store.get_job(job_id)).status.terminal:
        assert time.monotonic() < deadline, f"job {job_id} still {job.status.value} after {timeout}s"
        time.sleep(0.02)
    return job


def started(store: StoreForTests, celery_app: Celery, max_tokens: int) -> Job:
    """A long job, sent by task name, once its first token is stored."""
    job = store.create_job(JobRequest(prompt=LONG_PROMPT, max_tokens=max_tokens, temperature=0))
    celery_app.send_task(GENERATE_TASK, [job.id])
    deadline = time.monotonic() + 60
    while not store.read_log(job.id):
        assert time.monotonic() < deadline, "no token within 60s"
        time.sleep(0.01)
    return job


def test_task_by_name_runs_the_job(store: StoreForTests, celery_app: Celery) -> None:
    job = store.create_job(JobRequest(prompt="hello", max_tokens=12, temperature=0))
    celery_app.send_task(GENERATE_TASK, [job.id])
    got = finished(store, job.id)
    assert got.status is JobStatus.SUCCEEDED and got.usage.completion_tokens > 0
    assert store.get_record(job.id).worker.endswith("-w1")


def test_a_duplicate_message_does_not_run_the_job_twice(store: StoreForTests, celery_app: Celery) -> None:
    job = store.create_job(JobRequest(prompt=LONG_PROMPT, max_tokens=300, temperature=0))
    celery_app.send_task(GENERATE_TASK, [job.id])
    celery_app.send_task(GENERATE_TASK, [job.id])  # e.g. redelivered after the visibility timeout
    got = finished(store, job.id)
    log = store.read_log(job.id)
    assert got.status is JobStatus.SUCCEEDED and store.get_record(job.id).attempt == 1
    assert [e.seq for e in log] == list(range(1, len(log) + 1)) and sum(e.terminal for e in log) == 1


def test_cancel_reaches_the_worker(store: StoreForTests, celery_app: Celery) -> None:
    job = started(store, celery_app, 400)
    store.request_cancel(job.id)
    got = finished(store, job.id)
    assert got.status is JobStatus.CANCELLED and got.usage.completion_tokens < 400


def test_a_delivered_message_is_recorded_under_the_prefix_until_its_job_ends(
    store: StoreForTests, celery_app: Celery
) -> None:
    """kombu's record of the delivered, unacknowledged messages (what its visibility timeout
    would restore) is the prefix's own, and the acknowledgement at the job's end clears it."""
    unacked = store.keys.broker_unacked["unacked_key"]

    def recorded(key: str) -> bool:  # (Celery's message headers carry the task's args)
        return any(job.id in value for value in store.redis.hvals(key))

    job = started(store, celery_app, 400)
    assert recorded(unacked) and not recorded("unacked")  # (kombu's default name)
    store.request_cancel(job.id)
    finished(store, job.id)
    deadline = time.monotonic() + 10
    while recorded(unacked):  # acknowledged once the task has returned
        assert time.monotonic() < deadline, "the message was never acknowledged"
        time.sleep(0.01)


def test_remote_control_stays_within_the_prefix(
    worker: tuple[str, Service],
    celery_app: Celery,
    prefixes,  # type: ignore[no-untyped-def]
) -> None:
    """`celery inspect`, `celery control` and Flower reach this prefix's workers and no other's,
    as every other name is namespaced: deployments and tests share one Redis."""
    # The worker's heartbeat comes before its consumer starts: wait for its answer.
    deadline = time.monotonic() + 20
    while not (replies := celery_app.control.ping(timeout=1)):
        assert time.monotonic() < deadline, "the worker never answered a ping"
    assert len(replies) == 1
    elsewhere = make_app(load_settings(redis_url=REDIS_URL, redis_prefix=prefixes.new()))
    assert elsewhere.control.ping(timeout=1.5) == []


def test_warm_shutdown_finishes_the_running_job(
    worker: tuple[str, Service], store: StoreForTests, celery_app: Celery
) -> None:
    job = started(store, celery_app, 300)
    worker[1].stop()  # SIGTERM: Celery's warm shutdown lets running tasks end
    got = store.get_job(job.id)
    assert got.status is JobStatus.SUCCEEDED and got.usage.completion_tokens == 300
    assert store.list_workers() == []  # the heartbeat goes with the worker
