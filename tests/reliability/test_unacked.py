"""kombu's records of unacknowledged messages: what the visibility-timeout restore does with a
dead worker's message whose job another worker finished, and what keeps them from piling up.

A worker killed mid-job leaves its message recorded in ``{p}.unacked`` and ``{p}.unacked_index``
(the delivery was never acknowledged); another worker's sweep requeues the job and finishes it.
kombu hands such a record out again once the visibility timeout (an hour) passed; until then,
every kill added records (117 after 7 kills).

The same goes for a dead worker's field in ``{p}:attempts`` when its job's hash went meanwhile
(lost, expired): no take-over, so no last append, ever drops it; the sweep does.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from breakers import JobWatch, Workers, poll
from kombu import Connection
from procs import REDIS_URL, Service, finished_job, start_api

from api.enqueue import Enqueuer
from common.keys import Keys
from common.settings import Settings
from workers.broker import Transport

pytestmark = pytest.mark.slow  # workers killed

MAX_TOKENS = 400


@pytest.fixture(scope="module")
def r() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    yield client
    client.close()


@pytest.fixture(scope="module")
def unacked_api(worker_pool: Workers, log_dir: Path) -> Iterator[Service]:
    worker_pool.start("a")
    worker_pool.start("b")
    api = start_api(worker_pool.prefix, log_dir)
    yield api
    api.stop()


def records(r: redis.Redis, keys: Keys) -> tuple[set[str], set[str]]:
    names = keys.broker_unacked
    return set(r.hkeys(names["unacked_key"])), set(r.zrange(names["unacked_index_key"], 0, -1))


def test_a_killed_workers_delivery_record_goes_once_its_job_has_ended(
    worker_pool: Workers, unacked_api: Service, r: redis.Redis, figures: dict[str, Any]
) -> None:
    keys = Keys(worker_pool.prefix)
    with httpx.Client(base_url=unacked_api.url, timeout=30) as client:
        job_id = client.post(
            "/v1/jobs", json={"prompt": "the quick brown fox", "max_tokens": MAX_TOKENS, "temperature": 0}
        ).json()["id"]
        watch = JobWatch(r, keys, job_id)
        poll(lambda: watch.tokens() >= 5, "the job under way", 60)
        victim = worker_pool.by_full_name(watch.field("worker"))
        [dead_tag] = records(r, keys)[0]  # the victim's delivery, recorded and never acknowledged
        worker_pool.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        job = finished_job(client, unacked_api.url, job_id)
        assert job["status"] == "succeeded" and watch.field("attempt") == "2"
    # Before: the record stayed for the visibility timeout (an hour); now a sweep drops it.
    poll(lambda: dead_tag not in set.union(*records(r, keys)), "the dead delivery's record to go", 30)
    figures["unacked_record_dropped_after_kill_s"] = round(time.monotonic() - killed_at, 2)
    worker_pool.start(victim)  # the pool as it was, for the next test


def test_the_restore_of_an_ended_jobs_message_does_nothing_but_drop_its_record(
    worker_pool: Workers, unacked_api: Service, r: redis.Redis
) -> None:
    """kombu's own visibility-timeout restore, run against a record as a killed worker leaves it:
    the message goes back on the queue, a worker takes it, finds its job ended and acknowledges
    it, which removes the record; the job stays as it was."""
    keys, settings = Keys(worker_pool.prefix), Settings(redis_url=REDIS_URL, redis_prefix=worker_pool.prefix)
    with httpx.Client(base_url=unacked_api.url, timeout=30) as client:
        job_id = client.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 8, "temperature": 0}).json()[
            "id"
        ]
        before = finished_job(client, unacked_api.url, job_id)
        watch = JobWatch(r, keys, job_id)
        log_before = watch.log()
        # The record a worker killed before it acknowledged would leave, older than the timeout.
        message = json.loads(Enqueuer(settings).generate(job_id, worker_pool.queue).payload)
        tag = message["properties"]["delivery_tag"]
        names = keys.broker_unacked
        r.hset(names["unacked_key"], tag, json.dumps([message, "", worker_pool.queue]))
        r.zadd(names["unacked_index_key"], {tag: 0})
        options = {**names, "visibility_timeout": 60}
        with Connection(settings.redis_url, transport=Transport, transport_options=options) as conn:
            conn.default_channel.qos.restore_visible(num=10, interval=1)
        # Back on the queue, a worker takes it (and records its delivery under the same tag).
        poll(lambda: not any(r.llen(q) for q in keys.queue_lists(worker_pool.queue)), "the message taken", 30)
        poll(lambda: tag not in set.union(*records(r, keys)), "its delivery acknowledged", 30)
    # A worker took that very message (not a sweep that dropped the record before the restore).
    received = f"Task spool.generate[{message['headers']['id']}] received"
    poll(lambda: any(received in w.log_path.read_text() for w in worker_pool.procs.values()), received, 30)
    with httpx.Client(base_url=unacked_api.url, timeout=30) as client:
        assert client.get(f"/v1/jobs/{job_id}").json() == before
    assert watch.log() == log_before and watch.field("attempt") == "1"


def test_the_attempts_field_of_a_job_lost_with_its_worker_goes(
    worker_pool: Workers, unacked_api: Service, r: redis.Redis
) -> None:
    keys = Keys(worker_pool.prefix)
    with httpx.Client(base_url=unacked_api.url, timeout=30) as client:
        job_id = client.post(
            "/v1/jobs", json={"prompt": "the quick brown fox", "max_tokens": MAX_TOKENS, "temperature": 0}
        ).json()["id"]
    watch = JobWatch(r, keys, job_id)
    poll(lambda: watch.tokens() >= 5, "the job under way", 60)
    assert r.hget(keys.attempts(0), job_id) == "1"
    victim = worker_pool.by_full_name(watch.field("worker"))
    worker_pool.kill(victim, signal.SIGKILL)
    # Gone with its worker, before any sweep could requeue it (its heartbeat lives a TTL longer).
    r.delete(keys.job(job_id), keys.job_log(job_id), keys.job_text(job_id))
    # Before: the field stayed for good; now the other worker's sweep drops it.
    poll(lambda: not r.hexists(keys.attempts(0), job_id), "its attempts field to go", 30)
    poll(lambda: r.zscore(keys.running_jobs(0), job_id) is None, "its lease to go too", 30)
    worker_pool.start(victim)  # the pool as it was, for the next test
