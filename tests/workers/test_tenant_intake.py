"""A real `spool worker` whose Celery task threads all hold one tenant's jobs takes another
tenant's job at once (workers/tenant_intake.py), not when one of those jobs ends; and the intake's
thread, with a job of every tenant queue held, waits rather than spins."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import REDIS_URL, Prefixes, Service, wait_until, worker_alone
from store_helpers import StoreForTests, store_on

from api.enqueue import Enqueuer
from common.keys import JOB_PRIORITY, Keys
from common.schemas.requests import JobRequest
from common.schemas.views import Job, JobStatus
from common.store.broker_lists import BrokerLists
from common.tenants import tenant_of
from workers.celery_app import SPARE_TASK_THREADS
from workers.task_common import Outcome
from workers.tenant_intake import BLOCK_S, TenantIntake, job_of

LONG_PROMPT = "the quick brown fox"  # greedy on the tiny model runs to max_tokens (no EOS)
SLOTS = 2


@pytest.fixture(scope="module")
def worker(prefixes: Prefixes, tiny_model: Path, log_dir: Path) -> Iterator[tuple[str, Service]]:
    yield from worker_alone(prefixes, tiny_model, log_dir, slots=SLOTS)


@pytest.fixture(scope="module")
def store(worker: tuple[str, Service], tiny_model: Path) -> Iterator[StoreForTests]:
    yield from store_on(REDIS_URL, worker[0], tiny_model)


def owners(queue: str) -> tuple[str, str]:
    """Two owners (API key hashes) whose jobs go to different tenant queues."""
    candidates = [f"{c:x}" * 64 for c in range(16)]
    first = Keys.tenant_queue(queue, tenant_of(candidates[0]))
    return candidates[0], next(o for o in candidates if Keys.tenant_queue(queue, tenant_of(o)) != first)


def submit(store: StoreForTests, owner: str, max_tokens: int) -> Job:
    queue = store.settings.keys.model_queue(store.settings.served_model)
    enqueuer = Enqueuer(store.settings)
    request = JobRequest(prompt=LONG_PROMPT, max_tokens=max_tokens, temperature=0)
    return store.create_job(
        request, owner, message_for=lambda j: enqueuer.generate(j, queue, JOB_PRIORITY, tenant_of(owner))
    )


def test_a_message_of_a_tenant_it_holds_no_job_of_is_taken_while_every_task_thread_is_busy(
    store: StoreForTests, worker: tuple[str, Service]
) -> None:
    queue = store.settings.keys.model_queue(store.settings.served_model)
    flood, trickle = owners(queue)
    threads = SLOTS + SPARE_TASK_THREADS  # the worker's Celery concurrency
    # More long jobs of one tenant than the worker has task threads: all of them hold one.
    floods = [submit(store, flood, 500) for _ in range(threads + 2)]
    wait_until(
        lambda: sum(store.get_job(j.id).status is JobStatus.RUNNING for j in floods) >= threads,
        "every task thread to hold a flood job",
        60,
        worker[1:],
    )
    job = submit(store, trickle, 8)
    # The tenant intake takes it (before: Celery, once a flood job ended and was acknowledged).
    # Which thread took it is in the worker's log: a flood job's end would also hand it over.
    taken = f"job {job.id}: taken by the tenant intake"
    log = worker[1].log_path
    wait_until(
        lambda: taken in log.read_text(errors="replace"), "the tenant intake to take it", 60, worker[1:]
    )
    for j in floods:
        store.request_cancel(j.id)
    wait_until(lambda: store.get_job(job.id).status.terminal, "the trickle's job to end", 120, worker[1:])
    assert store.get_job(job.id).status is JobStatus.SUCCEEDED


def test_job_of_reads_the_job_id_of_a_generate_message(store: StoreForTests) -> None:
    message = Enqueuer(store.settings).generate("job-1", "q", JOB_PRIORITY, "t")
    assert job_of(message.payload) == "job-1"
    assert job_of("not json") is None


def test_with_a_job_of_every_tenant_queue_held_the_intake_waits_instead_of_spinning(
    store: StoreForTests,
) -> None:
    """Nothing to BRPOP on: the thread looks at the held tenants again every BLOCK_S, no more
    often (it spun on them, a core's worth of GIL taken from the engine, with 8 tenants' jobs held)."""
    queue = f"{store.settings.redis_prefix}.spin-check"
    looks = 0

    def every_tenant_queue() -> set[str]:
        nonlocal looks
        looks += 1
        return set(Keys.consumed_queues(queue)[1:])

    def run(job_id: str) -> Outcome:
        raise AssertionError(f"nothing to run, yet {job_id} was")

    stop = threading.Event()
    intake = TenantIntake(BrokerLists(store.broker), queue, every_tenant_queue, run, 1, stop)
    with intake.task():  # the one task thread busy
        intake.start()
        window_s = 2.5 * BLOCK_S
        stop.wait(window_s)  # a window of time to count in, not a condition to wait for
        stop.set()
        intake.join(5 * BLOCK_S)
    assert 1 <= looks <= window_s / BLOCK_S + 1
