"""The stores with the broker on a Redis apart (SPOOL_BROKER_URL), on two private redis-servers:
the messages the scripts write with their jobs (a job's, its parts', a held or dependent image
part's sent later by a worker's append or the hold's bound) reach the broker's lists through the
outbox, none stays on the data Redis, and a relay the broker refuses gives them back in order."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from store_helpers import StoreForTests

from api.enqueue import Enqueuer
from common.keys import JOB_PRIORITY, Keys, part_id
from common.schemas.events import DoneEvent, LogEntry
from common.schemas.requests import JobRequest
from common.schemas.views import Job, JobStatus, Usage
from common.settings import Settings, load_settings
from common.store import Append, AsyncJobStore, Final, token_entry
from spool_cli import procs as harness

TEXT = {"type": "text", "prompt": "hi", "max_tokens": 4}
IMAGE = {"type": "image", "prompt": "a boat", "size": "32x32", "steps": 2}
MODEL = "m"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    log_dir = tmp_path_factory.mktemp("outbox")
    broker, broker_url = harness.start_redis(log_dir=log_dir)
    data, data_url = harness.start_redis(log_dir=log_dir)
    yield broker_url, data_url
    harness.stop_all([broker, data])


@pytest.fixture
def apart(servers: tuple[str, str], prefixes: Any) -> Settings:
    broker_url, data_url = servers
    return load_settings(
        redis_url=data_url, broker_url=broker_url, redis_prefix=prefixes.new(), served_model_name=MODEL
    )


@pytest.fixture
def store(apart: Settings) -> Iterator[StoreForTests]:
    s = StoreForTests.from_settings(apart)
    yield s
    s.close()


def sent(r: redis.Redis, queue: str) -> list[str]:
    """The job (or part) ids the messages of a queue carry (at JOB_PRIORITY), oldest first."""
    messages = r.lrange(Keys.broker_list(queue, JOB_PRIORITY), 0, -1)
    return [json.loads(base64.b64decode(json.loads(m)["body"]))[0][0] for m in reversed(messages)]


def create(settings: Settings, body: dict[str, Any]) -> Job:
    enqueuer = Enqueuer(settings)
    queue = settings.keys.model_queue(MODEL)

    async def go() -> Job:
        store = AsyncJobStore.from_settings(settings)
        try:
            request = JobRequest.accept(body, settings)
            return await store.create_job(
                request, "", lambda j: enqueuer.generate(j, queue), None, enqueuer.media
            )
        finally:
            await store.close()

    return asyncio.run(go())


def data_holds_no_broker_keys(store: StoreForTests) -> bool:
    keys = store.keys
    assert outboxed(store) == 0
    return not list(store.redis.scan_iter(f"{keys.prefix}.*"))


def test_a_jobs_message_reaches_the_broker_through_the_outbox(store: StoreForTests, apart: Settings) -> None:
    job = create(apart, {"prompt": "hi", "max_tokens": 4})
    queue = apart.keys.tenant_queue(apart.keys.model_queue(MODEL), "")  # the one tenant's (no keys)
    assert sent(store.broker, queue) == [job.id]
    assert data_holds_no_broker_keys(store)
    assert store.redis.zrange(apart.keys.queued_jobs(apart.keys.bucket_of(job.id)), 0, -1) == [job.id]


def test_held_and_dependent_parts_are_relayed_after_the_text_parts_append(
    store: StoreForTests, apart: Settings
) -> None:
    job = create(apart, {"parts": [TEXT, IMAGE, {**IMAGE, "prompt": None, "prompt_from": 0}]})
    keys, broker = apart.keys, store.broker
    text = part_id(job.id, 0)
    assert sent(broker, keys.tenant_queue(keys.model_queue(MODEL), "")) == [text]
    assert (
        len(sent(broker, keys.queue_media)) == 0
    )  # held for the text part's first token; the other waits for its end
    taken = store.take_job(text, "w", MODEL)
    done = LogEntry.done(
        2, DoneEvent(status=JobStatus.SUCCEEDED, finish_reason="length", usage=Usage.of(2, 1))
    )
    store.append_batch(
        [
            Append(
                text,
                taken.attempt,
                [token_entry(1, 0, "tok", [7]), done],
                2,
                1,
                Final(JobStatus.SUCCEEDED, "length"),
            )
        ]
    )
    # part_append.lua's send_part wrote both onto the outbox; the worker's store relayed them.
    assert sorted(sent(broker, keys.queue_media)) == [
        part_id(job.id, 1),
        part_id(job.id, 2),
    ]
    assert data_holds_no_broker_keys(store)


def test_a_held_part_past_its_bound_is_relayed(store: StoreForTests, apart: Settings) -> None:
    job = create(apart, {"parts": [TEXT, IMAGE]})
    assert len(sent(store.broker, apart.keys.queue_media)) == 0
    assert store.release_held(time.time() + 3600) is None
    assert sent(store.broker, apart.keys.queue_media) == [part_id(job.id, 1)]
    assert data_holds_no_broker_keys(store)


def test_a_relay_the_broker_refuses_gives_the_messages_back_in_order(
    store: StoreForTests, apart: Settings
) -> None:
    """With the broker unreachable the job is still stored and its message waits in the outbox,
    oldest first; the next relay delivers them in that order."""
    settings = apart.model_copy(update={"broker_url": f"redis://127.0.0.1:{harness.free_port()}/0"})
    first, second = (
        create(settings, {"prompt": "a", "max_tokens": 4}),
        create(settings, {"prompt": "b", "max_tokens": 4}),
    )
    assert outboxed(store) == 2
    down = StoreForTests.from_settings(settings)
    assert down.outbox is not None
    try:
        with pytest.raises(redis.ConnectionError):
            down.outbox.relay()
    finally:
        down.close()
    assert outboxed(store) == 2
    assert store.relay() == 2
    assert sent(store.broker, apart.keys.tenant_queue(apart.keys.model_queue(MODEL), "")) == [
        first.id,
        second.id,
    ]
    assert data_holds_no_broker_keys(store)


def outboxed(store: StoreForTests) -> int:
    """Messages waiting in the outboxes of every bucket."""
    return sum(store.redis.llen(store.keys.outbox(b)) for b in store.keys.bucket_range())
