"""The jobs' Celery messages: as Celery itself would send them, exactly one per job, and one job
per Idempotency-Key."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from celery import Celery
from procs import REDIS_URL, Prefixes, Service, start_api

from api.enqueue import Enqueuer
from api.routes.jobs import READY_HEADER
from common.keys import GENERATE_TASK, JOB_PRIORITY, MEDIA_TASK, Keys
from common.schemas.views import WorkerHeartbeat
from common.settings import DEFAULT_SERVED_MODEL, Settings
from common.store import SyncJobStore

BURST = 48


@pytest.fixture
def api_alone(prefixes: Prefixes, log_dir: Path) -> Iterator[Service]:
    """An API with no worker, under a prefix of its own: its messages stay in the queue."""
    api = start_api(prefixes.new(), log_dir, ready=False)
    yield api
    api.stop()


def queued_messages(
    client: redis.Redis, prefix: str, model: str = DEFAULT_SERVED_MODEL
) -> list[tuple[str, list[object]]]:
    """(task name, args) of every message in the prefix's Celery queue of a model, by default the
    default model's (no worker is live and no request names one) (kombu's Redis format)."""
    keys = Keys(prefix)
    found = []
    for name in keys.queue_lists(keys.model_queue(model)):
        for raw in client.lrange(name, 0, -1):
            message = json.loads(raw)
            args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
            found.append((message["headers"]["task"], args))
    return found


def test_a_burst_of_submits_sends_one_message_per_job(api_alone: Service, prefixes: Prefixes) -> None:
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            posts = [
                client.post(f"{api_alone.url}/v1/jobs", json={"prompt": f"job {i}", "max_tokens": 1})
                for i in range(BURST)
            ]
            return await asyncio.gather(*posts)

    answers = asyncio.run(burst())
    assert [r.status_code for r in answers] == [202] * BURST
    ids = sorted(r.json()["id"] for r in answers)
    assert len(set(ids)) == BURST
    messages = queued_messages(prefixes.client, api_alone.prefix)
    assert all(task == GENERATE_TASK for task, _ in messages)
    assert sorted(str(args[0]) for _, args in messages) == ids  # each job once, none lost


def test_a_job_naming_no_model_while_no_worker_is_live_waits_for_the_model_served_last(
    api_alone: Service, prefixes: Prefixes
) -> None:
    """While no heartbeat is live (the workers restart, or Redis did and they have not beaten
    since), a job that names no model goes to the queue of the text model the workers served,
    the first in order, where they will look: not to the API's own default, which none reads."""
    settings = Settings.model_validate({"redis_url": REDIS_URL, "redis_prefix": api_alone.prefix})
    store = SyncJobStore(redis.Redis.from_url(REDIS_URL, decode_responses=True), settings)
    served = [("w-c", "model-c", "text"), ("w-b", "model-b", "text"), ("m-a", "a-pipeline", "media")]
    for name, model, kind in served:
        store.beat(WorkerHeartbeat(name=name, ts=time.time(), engine={}, model=model, kind=kind))
        store.remove_heartbeat(name)  # it stopped; a lapsed heartbeat is the same to the API

    posted = httpx.post(f"{api_alone.url}/v1/jobs", json={"prompt": "hi", "max_tokens": 1}, timeout=30)
    assert posted.status_code == 202, posted.text
    assert posted.headers[READY_HEADER] == "false"  # no worker is live
    client = prefixes.client
    assert queued_messages(client, api_alone.prefix, "model-b") == [(GENERATE_TASK, [posted.json()["id"]])]
    assert queued_messages(client, api_alone.prefix) == []
    status = httpx.get(f"{api_alone.url}/console-status", timeout=30).json()
    assert status["queues"]["llm"] == 1, status  # model-b's queue is counted, though none serves it now


def test_a_jobs_message_is_the_one_celery_would_send(prefixes: Prefixes) -> None:
    """The API writes kombu's Redis envelope itself (api/enqueue.py): it must stay what
    ``send_task`` writes, whatever Celery and kombu versions are installed."""
    settings = Settings.model_validate({"redis_url": REDIS_URL, "redis_prefix": prefixes.new()})
    keys = settings.keys

    def per_message_fields_blanked(raw: str | bytes) -> dict[str, object]:
        message = json.loads(raw)
        for field in ("id", "root_id"):
            message["headers"][field] = None
        # reply_to: send_task names its thread's result queue; no result backend reads it here.
        for field in ("correlation_id", "delivery_tag", "reply_to"):
            message["properties"][field] = None
        return message

    # A job's, and a held image part's (its task's keyword argument).
    enqueuer = Enqueuer(settings)
    cases = [
        (  # an interactive job's goes to its tenant's queue of its model (TENANT_QUEUES)
            enqueuer.generate("job-1", keys.model_queue("m"), tenant="0123456789ab"),
            GENERATE_TASK,
            "job-1",
            keys.tenant_queue(keys.model_queue("m"), "0123456789ab"),
            {},
        ),
        (
            enqueuer.media("job-1:part:1", held=True),
            MEDIA_TASK,
            "job-1:part:1",
            keys.queue_media,
            {"held": True},
        ),
    ]
    for ours, task, arg, queue, kwargs in cases:
        celery = Celery("reference", broker=REDIS_URL, set_as_current=False)
        try:
            celery.send_task(task, args=[arg], kwargs=kwargs, queue=queue, priority=JOB_PRIORITY)
        finally:
            celery.close()
        (theirs,) = prefixes.client.lrange(keys.broker_list(queue, JOB_PRIORITY), 0, -1)
        assert ours.list_key == keys.broker_list(queue, JOB_PRIORITY)
        assert ours.queue == (keys.queue_media if task == MEDIA_TASK else keys.model_queue("m"))  # the job's
        assert per_message_fields_blanked(ours.payload) == per_message_fields_blanked(theirs)
        mine = json.loads(ours.payload)
        assert mine["headers"]["id"] == mine["headers"]["root_id"] == mine["properties"]["correlation_id"]


def test_a_submit_repeated_with_its_idempotency_key_is_the_same_job(
    api_alone: Service, prefixes: Prefixes
) -> None:
    url, body = f"{api_alone.url}/v1/jobs", {"prompt": "only once", "max_tokens": 2}
    key = {"Idempotency-Key": "3f2b8a50-9c1e-4f7a-b1d2-0c6a1e9d7f10"}
    with httpx.Client(timeout=30) as client:
        answers = [client.post(url, json=body, headers=key) for _ in range(3)]
        assert [r.status_code for r in answers] == [202] * 3
        assert len({r.json()["id"] for r in answers}) == 1
        assert len({r.headers["Location"] for r in answers}) == 1
        other = client.post(url, json=body, headers={"Idempotency-Key": "another"})
        assert other.status_code == 202 and other.json()["id"] != answers[0].json()["id"]

        reused = client.post(url, json={**body, "max_tokens": 3}, headers=key)
        assert reused.status_code == 409
        error = reused.json()["error"]
        assert (error["code"], error["param"]) == ("idempotency_key_reused", "Idempotency-Key")
        assert answers[0].json()["id"] in error["message"]

        for bad in ("", "has space", "x" * 256, "caf\u00e9"):
            refused = client.post(url, json=body, headers={"Idempotency-Key": bad.encode()})
            assert 400 <= refused.status_code < 500 and "error" in refused.json(), bad
    ids = sorted(str(args[0]) for _, args in queued_messages(prefixes.client, api_alone.prefix))
    assert ids == sorted([answers[0].json()["id"], other.json()["id"]])  # one message per job
