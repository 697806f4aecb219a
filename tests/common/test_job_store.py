"""The job store against the real Redis: transitions, fencing, cancel, expiry, heartbeats."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

import pytest
import redis
from procs import wait_until
from store_helpers import StoreForTests

from common.keys import JOB_PRIORITY, WATCHER_GHOST
from common.schemas.events import DoneEvent, ErrorEvent, LogEntry
from common.schemas.requests import JobRequest
from common.schemas.views import JobError, JobStatus, Usage, WorkerHeartbeat
from common.settings import Settings
from common.store import (
    Append,
    Appended,
    AsyncJobStore,
    Conflict,
    Final,
    IdempotencyConflict,
    JobNotFound,
    QueueFull,
    QueueMessage,
    TakeStatus,
    cancelled_done_entry,
    token_entry,
)
from common.store.calls import queued_limit
from spool_cli import procs as harness


def subscribe(store: StoreForTests, channel: str, sharded: bool = True) -> redis.client.PubSub:
    """A subscription that Redis has confirmed, so nothing published afterwards is missed. A job's
    events go on a shard channel (SSUBSCRIBE); the cancel channel is a plain one (SUBSCRIBE)."""
    pubsub = store.redis.pubsub()
    if sharded:
        pubsub.ssubscribe(channel)
    else:
        pubsub.subscribe(channel)

    def confirmed() -> bool:
        msg = pubsub.get_message(timeout=0.5)
        return bool(msg and msg["type"] == ("ssubscribe" if sharded else "subscribe"))

    wait_until(confirmed, f"the subscribe confirmation for {channel}", 30)
    return pubsub


def next_messages(pubsub: redis.client.PubSub, n: int) -> list[str]:
    got: list[str] = []

    def arrived() -> bool:
        msg = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
        if msg:
            got.append(msg["data"])
        return len(got) >= n

    wait_until(arrived, f"{n} messages", 30)
    return got


def run_job(store: StoreForTests, texts: list[str], attempt: int, job_id: str, first_seq: int = 1) -> Append:
    entries = [token_entry(first_seq + i, first_seq - 1 + i, t, [i]) for i, t in enumerate(texts)]
    return Append(job_id, attempt, entries, prompt_tokens=3, completion_tokens=first_seq - 1 + len(texts))


def done(seq: int, status: JobStatus = JobStatus.SUCCEEDED, reason: str = "stop") -> LogEntry:
    return LogEntry.done(seq, DoneEvent(status=status, finish_reason=reason, usage=Usage.of(3, seq - 1)))


def test_create_and_get(store: StoreForTests) -> None:
    job = store.create_job(JobRequest(prompt="hello", max_tokens=5))
    rec = store.get_record(job.id)
    assert rec.job == job
    assert job.status is JobStatus.QUEUED and job.text == "" and job.usage.total_tokens == 0
    assert rec.request.prompt == "hello" and rec.attempt == 0 and not rec.cancel_requested
    assert store.redis.zscore(store.keys.queued_jobs(store.keys.bucket_of(job.id)), job.id) is not None
    with pytest.raises(JobNotFound):
        store.get_job("nope")


def test_queue_full_refuses_atomically(store: StoreForTests, settings: Settings) -> None:
    """One bucket (a standalone Redis) holds SPOOL_MAX_QUEUED_JOBS; with buckets, each holds its
    share of them (create.lua sees its own), so the first refusal comes when one is full."""
    keys = store.keys
    with pytest.raises(QueueFull):
        for _ in range(settings.max_queued_jobs + 1):
            store.create_job(JobRequest(prompt="x"))
    counts = [store.redis.zcard(keys.queued_jobs(b)) for b in keys.bucket_range()]
    assert max(counts) == queued_limit(keys, settings) and sum(counts) <= settings.max_queued_jobs
    if keys.buckets == 1:  # Taking a job frees a place in the queue.
        queued = store.redis.zrange(keys.queued_jobs(0), 0, 0)[0]
        assert store.take_job(queued, "w", "m").status is TakeStatus.TAKEN
        store.create_job(JobRequest(prompt="x"))


def test_a_job_and_its_message_are_stored_together(store: StoreForTests, settings: Settings) -> None:
    queue = store.keys.broker_list(store.keys.model_queue("m"), JOB_PRIORITY)

    def message_for(job_id: str) -> QueueMessage:
        return QueueMessage(queue, f"message of {job_id}")

    jobs = []
    with pytest.raises(QueueFull):  # (a bucket's share of the queue full: see the test above)
        for _ in range(settings.max_queued_jobs + 1):
            jobs.append(store.create_job(JobRequest(prompt="x"), message_for=message_for))
    # One message per stored job, in order; none for the refused one.
    assert store.redis.lrange(queue, 0, -1)[::-1] == [f"message of {job.id}" for job in jobs]


def test_an_idempotency_key_creates_one_job(store: StoreForTests, settings: Settings) -> None:
    queue = store.keys.broker_list(store.keys.model_queue("m"), JOB_PRIORITY)

    def message_for(job_id: str) -> QueueMessage:
        return QueueMessage(queue, job_id)

    request = JobRequest(prompt="once", max_tokens=3)
    first = store.create_job(request, "alice", message_for, idempotency_key="k-1")
    # Other keys in its bucket, whose share of the queue they fill (one bucket: the whole queue).
    keys = (f"fill-{i}" for i in itertools.count())
    fill = (k for k in keys if store.keys.idempotency_bucket("alice", k) == store.keys.bucket_of(first.id))
    for _ in range(queued_limit(store.keys, settings) - 1):  # the queue fills up...
        store.create_job(JobRequest(prompt="x"), "alice", idempotency_key=next(fill))
    with pytest.raises(QueueFull):
        store.create_job(JobRequest(prompt="x"), "alice", idempotency_key=next(fill))
    # ...yet the same submit again is the same job (no new load), with no second message.
    assert store.create_job(request, "alice", message_for, idempotency_key="k-1") == first
    assert store.redis.lrange(queue, 0, -1) == [first.id]
    ttl = store.redis.ttl(store.keys.idempotency("alice", "k-1"))
    assert 0 < ttl <= settings.job_ttl_s
    with pytest.raises(IdempotencyConflict):  # the same key for another request
        store.create_job(
            JobRequest(prompt="twice", max_tokens=3), "alice", message_for, idempotency_key="k-1"
        )
    # Another owner's key of the same text is another key: a new job, refused in a full bucket.
    if store.keys.idempotency_bucket("bob", "k-1") == store.keys.bucket_of(first.id):
        with pytest.raises(QueueFull):
            store.create_job(request, "bob", message_for, idempotency_key="k-1")
    else:
        assert store.create_job(request, "bob", message_for, idempotency_key="k-1").id != first.id


def test_take_then_append_then_finish(store: StoreForTests, settings: Settings) -> None:
    job = store.create_job(JobRequest(prompt="hello"))
    taken = store.take_job(job.id, "w1", "tiny")
    assert taken.status is TakeStatus.TAKEN and taken.attempt == 1 and taken.log == []
    assert taken.record is not None and taken.record.job.status is JobStatus.RUNNING
    assert taken.record.worker == "w1" and taken.record.job.model == "tiny" and taken.record.job.started_at
    assert store.redis.zscore(store.keys.queued_jobs(store.keys.bucket_of(job.id)), job.id) is None
    assert store.redis.zscore(store.keys.running_jobs(store.keys.bucket_of(job.id)), job.id) is not None
    assert store.take_job(job.id, "w2", "tiny").status is TakeStatus.BUSY

    pubsub = subscribe(store, store.keys.job_events(job.id))
    assert store.append_batch([run_job(store, ["he", "llo"], 1, job.id)]) == [Appended.WRITTEN]
    final = Final(JobStatus.SUCCEEDED, "stop")
    last = Append(job.id, 1, [token_entry(3, 2, "!", [9]), done(4)], 3, 3, final)
    assert store.append_batch([last]) == [Appended.WRITTEN]
    published = next_messages(pubsub, 4)
    pubsub.close()
    assert [LogEntry.decode(m).seq for m in published] == [1, 2, 3, 4]

    got = store.get_job(job.id)
    assert got.status is JobStatus.SUCCEEDED and got.text == "hello!" and got.finish_reason == "stop"
    assert got.usage.model_dump() == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert got.finished_at and got.finished_at >= got.started_at  # type: ignore[operator]
    assert [e.seq for e in store.read_log(job.id, after=2)] == [3, 4]
    assert store.redis.get(store.keys.job_text(job.id)) == "hello!"  # what get_job read
    for key in (store.keys.job(job.id), store.keys.job_log(job.id), store.keys.job_text(job.id)):
        assert 0 < store.redis.ttl(key) <= settings.job_ttl_s
    assert store.redis.zscore(store.keys.running_jobs(store.keys.bucket_of(job.id)), job.id) is None
    assert store.take_job(job.id, "w2", "tiny").status is TakeStatus.FINISHED


def test_failed_job_stores_its_error(store: StoreForTests) -> None:
    job = store.create_job(JobRequest(prompt="hello"))
    attempt = store.take_job(job.id, "w1", "tiny").attempt
    err = ErrorEvent(message="too long", type="request_too_long")
    final = Final(JobStatus.FAILED, "error", JobError(message="too long", type="request_too_long"))
    assert store.append_batch([Append(job.id, attempt, [LogEntry.error(1, err)], 0, 0, final)]) == [
        Appended.WRITTEN
    ]
    got = store.get_job(job.id)
    assert got.status is JobStatus.FAILED and got.error == JobError(
        message="too long", type="request_too_long"
    )


def test_appends_are_fenced_and_idempotent(store: StoreForTests) -> None:
    job = store.create_job(JobRequest(prompt="hello"))
    store.take_job(job.id, "w1", "tiny")
    first = run_job(store, ["a", "b"], 1, job.id)
    assert store.append_batch([first]) == [Appended.WRITTEN]
    assert store.append_batch([first]) == [
        Appended.WRITTEN
    ]  # a retry after a dropped connection: no duplicate
    assert store.redis.llen(store.keys.job_log(job.id)) == 2
    gap = run_job(store, ["z"], 1, job.id, first_seq=5)
    stale = run_job(store, ["x"], 0, job.id, first_seq=3)  # a worker that lost the job
    assert store.append_batch([gap, stale]) == [Appended.GAP, Appended.FENCED]
    assert store.get_job(job.id).text == "ab"


def test_a_retry_completes_an_append_cut_short_after_its_entries(store: StoreForTests) -> None:
    """A call spanning slots cut short by a live resharding (common/store/steps.py) can leave an
    append's entries pushed and its checkpoint not written; the retry writes the rest, once."""
    job = store.create_job(JobRequest(prompt="hello"))
    store.take_job(job.id, "w1", "tiny")
    assert store.append_batch([run_job(store, ["a"], 1, job.id)]) == [Appended.WRITTEN]
    cut = dataclasses.replace(run_job(store, ["b", "c"], 1, job.id, first_seq=2), checkpoint=True)
    store.redis.rpush(
        store.keys.job_log(job.id), *(e.encode() for e in cut.entries)
    )  # what the cut call wrote
    assert store.redis.get(store.keys.job_text(job.id)) == "a"
    assert store.append_batch([cut]) == [Appended.WRITTEN]
    assert store.append_batch([cut]) == [Appended.WRITTEN]  # and a second retry writes nothing
    assert store.redis.llen(store.keys.job_log(job.id)) == 3
    assert store.redis.get(store.keys.job_text(job.id)) == "abc"
    assert store.redis.hget(store.keys.job(job.id), "text_seq") == "3"


def test_a_step_for_many_jobs_is_one_script_call(settings: Settings, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The writer's step goes out as one script call, whatever buckets its jobs are in (one per
    master on a Redis Cluster), fenced per job inside it with one HMGET per bucket: each append gets its own answer, and a job's next step in the same
    call finds the log its first step left."""
    proc, url = harness.start_redis(log_dir=tmp_path)
    try:
        store = StoreForTests(redis.Redis.from_url(url, decode_responses=True), settings)
        jobs = [store.create_job(JobRequest(prompt=f"job {i}")).id for i in range(3)]
        for job_id in jobs:
            store.take_job(job_id, "w1", "tiny")
        store.append_batch([run_job(store, ["x"], 1, jobs[2])])
        store.redis.config_resetstat()
        step = [
            run_job(store, ["a"], 1, jobs[0]),
            run_job(store, ["b"], 1, jobs[0], first_seq=2),  # the same job's next step
            run_job(store, ["c"], 0, jobs[1]),  # a stale attempt
            run_job(store, ["d"], 1, jobs[2], first_seq=3),  # the log holds seq 1 only
            run_job(store, ["x"], 1, jobs[2]),  # a retry of what is written already
        ]
        written, fenced, gap = Appended.WRITTEN, Appended.FENCED, Appended.GAP
        assert store.append_batch(step) == [written, written, fenced, gap, written]
        calls = {k: v["calls"] for k, v in store.redis.info("commandstats").items()}
        assert calls["cmdstat_evalsha"] == 1
        # Fenced at once: one HMGET per bucket, no HGET of a job's attempt. The one HGET is the
        # retry's, which finds its checkpoint written (text_seq) and writes nothing more.
        assert calls["cmdstat_hmget"] == len({store.keys.bucket_of(j) for j in jobs})
        assert calls["cmdstat_hget"] == 1
        assert [store.get_job(j).text for j in jobs] == ["ab", "", "x"]
        assert [store.redis.llen(store.keys.job_log(j)) for j in jobs] == [2, 0, 1]
        store.close()
    finally:
        harness.stop_all([proc])


def test_lapsed_lease_is_taken_over_with_the_log(store: StoreForTests) -> None:
    job = store.create_job(JobRequest(prompt="hello"))
    store.take_job(job.id, "w1", "tiny")
    store.append_batch([run_job(store, ["a", "b"], 1, job.id)])
    # The worker died: its lease is not renewed and lapses.
    store.redis.zadd(store.keys.running_jobs(store.keys.bucket_of(job.id)), {job.id: time.time() - 1})
    taken = store.take_job(job.id, "w2", "tiny")
    assert taken.status is TakeStatus.TAKEN and taken.attempt == 2
    assert [e.data["text"] for e in taken.log] == ["a", "b"]
    assert taken.record is not None and taken.record.worker == "w2"
    assert store.append_batch([run_job(store, ["c"], 1, job.id, first_seq=3)]) == [Appended.FENCED]
    assert store.append_batch([run_job(store, ["c"], 2, job.id, first_seq=3)]) == [Appended.WRITTEN]
    assert store.get_job(job.id).text == "abc"


def test_text_of_a_job_whose_text_key_was_lost(store: StoreForTests) -> None:
    """A job with a log and no text key has its text read from the log. A worker that takes such a
    job over starts the text key again with the text so far."""
    job = store.create_job(JobRequest(prompt="hello"))
    store.take_job(job.id, "w1", "tiny")
    store.append_batch([run_job(store, ["a", "", "ü"], 1, job.id)])
    store.redis.delete(store.keys.job_text(job.id))
    assert store.get_job(job.id).text == "aü"
    store.redis.zadd(store.keys.running_jobs(store.keys.bucket_of(job.id)), {job.id: time.time() - 1})
    assert store.take_job(job.id, "w2", "tiny").status is TakeStatus.TAKEN
    assert store.redis.get(store.keys.job_text(job.id)) == "aü"
    assert store.append_batch([run_job(store, ["c"], 2, job.id, first_seq=4)]) == [Appended.WRITTEN]
    assert store.get_job(job.id).text == "aüc"


def test_renew_leases_keeps_the_job(store: StoreForTests) -> None:
    job = store.create_job(JobRequest(prompt="hello"))
    store.take_job(job.id, "w1", "tiny")
    store.redis.zadd(store.keys.running_jobs(store.keys.bucket_of(job.id)), {job.id: time.time() - 1})
    assert store.renew_leases({job.id: 1, "finished-meanwhile": 1}) == ["finished-meanwhile"]
    assert store.take_job(job.id, "w2", "tiny").status is TakeStatus.BUSY
    gone = store.keys.running_jobs(store.keys.bucket_of("finished-meanwhile"))
    assert store.redis.zscore(gone, "finished-meanwhile") is None


def test_renew_leases_is_fenced(store: StoreForTests) -> None:
    """A worker that was taken over cannot keep the new holder's lease alive."""
    job = store.create_job(JobRequest(prompt="hello"))
    store.take_job(job.id, "w1", "tiny")
    store.redis.zadd(store.keys.running_jobs(store.keys.bucket_of(job.id)), {job.id: time.time() - 1})
    assert store.take_job(job.id, "w2", "tiny").attempt == 2
    store.redis.zadd(
        store.keys.running_jobs(store.keys.bucket_of(job.id)), {job.id: time.time() - 1}
    )  # w2 died too
    assert store.renew_leases({job.id: 1}) == [job.id]  # w1 comes back: not its job any more
    assert store.redis.zscore(store.keys.running_jobs(store.keys.bucket_of(job.id)), job.id) < time.time()


def test_a_restarted_worker_releases_only_its_own_leases(store: StoreForTests) -> None:
    mine, theirs = (store.create_job(JobRequest(prompt="hello")) for _ in range(2))
    store.take_job(mine.id, "w1", "tiny")
    store.take_job(theirs.id, "w2", "tiny")
    assert store.release_leases("w1") == [mine.id]
    assert store.take_job(mine.id, "w1", "tiny").status is TakeStatus.TAKEN  # lapsed: taken again
    assert store.take_job(theirs.id, "w1", "tiny").status is TakeStatus.BUSY  # w2's lease stands


def test_requeue_claim_is_once_per_gap(store: StoreForTests) -> None:
    queue = store.keys.model_queue("tiny")
    job = store.create_job(
        JobRequest(prompt="hello"), message_for=lambda j: QueueMessage(f"{queue}:sent", j, queue)
    )
    store.take_job(job.id, "w1", "tiny")
    now = time.time()
    assert not store.claim_requeue(job.id, now, 10)  # its lease is live
    assert store.lapsed_leases(now) == []
    store.redis.zadd(store.keys.running_jobs(store.keys.bucket_of(job.id)), {job.id: now - 1})
    assert store.lapsed_leases(now) == [(job.id, "w1", queue)]  # requeued to its model's queue
    assert store.live_workers(["w1"]) == set()
    assert [store.claim_requeue(job.id, now, 10) for _ in range(3)] == [True, False, False]
    assert store.claim_requeue(job.id, now + 11, 10)  # the requeue got lost: claim again
    store.append_batch([Append(job.id, 1, [done(1)], 1, 0, Final(JobStatus.SUCCEEDED, "stop"))])
    assert not store.claim_requeue(job.id, now + 30, 10)


def test_attempts_fields_of_jobs_that_no_longer_run_are_dropped_in_pages(store: StoreForTests) -> None:
    """A running job's field stays; those of jobs whose hash went while they ran, and of a job
    that ended without its last append dropping it (an older worker), go, a page at a time."""
    running, lost, ended = (store.create_job(JobRequest(prompt="hello")) for _ in range(3))
    for job in (running, lost, ended):
        store.take_job(job.id, "w1", "tiny")
    store.redis.delete(store.keys.job(lost.id))  # its hash went (expired, lost) while it ran
    store.append_batch([Append(ended.id, 1, [done(1)], 1, 0, Final(JobStatus.SUCCEEDED, "stop"))])
    name = store.keys.attempts(store.keys.bucket_of(running.id))
    store.redis.hset(name, ended.id, "1")  # as a worker of an older version leaves it
    store.redis.hset(name, mapping={f"gone-{i}": "1" for i in range(1000)})  # a hashtable, not a listpack

    cursor, pages = 0, []
    while not pages or cursor:
        cursor, dropped = store.drop_stale_attempts(cursor, 50)
        pages.append(dropped)
    assert max(pages) < 1000  # a page at a time, not the whole hash
    assert sum(pages) == 1002 and store.redis.hgetall(name) == {running.id: "1"}
    store.append_batch([run_job(store, ["hi"], 1, running.id)])  # still fenced by its field
    assert store.get_job(running.id).text == "hi"


def test_oldest_queued_are_one_models(store: StoreForTests) -> None:
    """A worker's intake takes only its model's queued jobs, oldest first."""
    a, b = store.keys.model_queue("a"), store.keys.model_queue("b")
    jobs = [
        store.create_job(
            JobRequest(prompt="x"), message_for=lambda j, q=q: QueueMessage(f"{q}:sent", j, q)
        ).id
        for q in (a, b, a)
    ]
    assert store.oldest_queued(5, a) == [jobs[0], jobs[2]]
    assert store.oldest_queued(1, a) == [jobs[0]]
    assert store.oldest_queued(5, b) == [jobs[1]]


@pytest.mark.parametrize("priority_list", [0, 1], ids=["requeues", "first-messages"])
def test_stale_queued_only_with_an_empty_celery_queue(store: StoreForTests, priority_list: int) -> None:
    model = store.keys.model_queue("m")
    job = store.create_job(
        JobRequest(prompt="hello"), message_for=lambda j: QueueMessage(f"{model}:sent", j, model)
    )
    later = time.time() + 1
    assert store.stale_queued(later, model) == [job.id]
    assert store.stale_queued(later, store.keys.model_queue("another")) == []  # another model's sweep
    queue = store.keys.queue_lists(model)[priority_list]
    store.redis.rpush(queue, "a message")
    assert store.stale_queued(later, model) == []
    store.redis.delete(queue)
    assert store.stale_queued(later - 60, model) == []  # not old enough
    assert store.claim_requeue(job.id, later, 10) and not store.claim_requeue(job.id, later, 10)


def test_job_ids_carry_128_random_bits(store: StoreForTests) -> None:
    ids = {store.create_job(JobRequest(prompt="p")).id for _ in range(3)}
    assert len(ids) == 3 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_cancel_queued_job_writes_the_terminal_event(store: StoreForTests) -> None:
    job = store.create_job(JobRequest(prompt="hello"))
    pubsub = subscribe(store, store.keys.job_events(job.id))
    got = store.request_cancel(job.id)
    assert got.status is JobStatus.CANCELLED and got.finish_reason == "cancelled" and got.finished_at
    assert store.request_cancel(job.id).status is JobStatus.CANCELLED  # twice is harmless
    assert store.read_log(job.id) == [cancelled_done_entry()]
    assert [LogEntry.decode(m) for m in next_messages(pubsub, 1)] == store.read_log(job.id)
    pubsub.close()
    assert store.redis.zscore(store.keys.queued_jobs(store.keys.bucket_of(job.id)), job.id) is None
    assert store.redis.ttl(store.keys.job(job.id)) > 0
    assert store.take_job(job.id, "w1", "tiny").status is TakeStatus.FINISHED


def test_cancel_running_job_asks_its_worker(store: StoreForTests) -> None:
    job = store.create_job(JobRequest(prompt="hello"))
    store.take_job(job.id, "w1", "tiny")
    pubsub = subscribe(store, store.keys.cancelled(), sharded=False)
    assert store.request_cancel(job.id).status is JobStatus.RUNNING
    assert store.request_cancel(job.id).status is JobStatus.RUNNING
    assert next_messages(pubsub, 2) == [job.id, job.id]
    pubsub.close()
    assert store.get_record(job.id).cancel_requested
    assert store.cancel_requested([job.id, "other"]) == [job.id]


def test_unwatched_jobs_are_those_nobody_has_watched_for_the_grace(
    store: StoreForTests, settings: Settings
) -> None:
    now, grace = time.time(), 30.0
    members = {
        "never": {},  # no watcher set at all
        "live": {"t": now + 10},  # a watcher whose lease runs
        "ghost": {f"{WATCHER_GHOST}t": now + 1},  # left less than the grace ago
        "ghost-gone": {f"{WATCHER_GHOST}t": now - 1},  # its grace over (its process's check died)
        "lapsed": {"t": now - grace + 1},  # its process died: the grace runs from the lapse
        "lapsed-long-ago": {"t": now - grace - 1, f"{WATCHER_GHOST}u": now - 5},
    }
    for job_id, scores in members.items():
        if scores:
            store.redis.zadd(store.keys.job_watchers(job_id), scores)
    unwatched = ["never", "ghost-gone", "lapsed-long-ago"]
    assert store.unwatched(list(members), grace) == unwatched

    async def api_side() -> list[str]:  # what an API process's check sees, and drops
        astore = AsyncJobStore.from_settings(settings)
        try:
            return [j for j in members if not await astore.watched(j, grace)]
        finally:
            await astore.close()

    assert asyncio.run(api_side()) == unwatched
    assert store.redis.zrange(store.keys.job_watchers("lapsed-long-ago"), 0, -1) == [f"{WATCHER_GHOST}u"]


def test_cancel_finished_job_is_a_conflict(store: StoreForTests) -> None:
    job = store.create_job(JobRequest(prompt="hello"))
    store.take_job(job.id, "w1", "tiny")
    store.append_batch([Append(job.id, 1, [done(1)], 1, 0, Final(JobStatus.SUCCEEDED, "stop"))])
    with pytest.raises(Conflict):
        store.request_cancel(job.id)
    with pytest.raises(JobNotFound):
        store.request_cancel("nope")


def test_appends_survive_a_script_cache_flush(store: StoreForTests) -> None:
    job = store.create_job(JobRequest(prompt="hello"))
    store.take_job(job.id, "w1", "tiny")
    real_sha = store._steps.script.sha
    # What Redis answers after a restart: NOSCRIPT for the sha the store knows.
    store._steps.script.sha = "0" * 40
    assert store.append_batch([run_job(store, ["a"], 1, job.id)]) == [Appended.WRITTEN]
    assert store._steps.script.sha == real_sha
    assert store.get_job(job.id).text == "a"


def test_heartbeats_expire(store: StoreForTests, settings: Settings) -> None:
    beat = WorkerHeartbeat(name="w1", ts=time.time(), engine={"peak_batch_size": 2}, model="tiny")
    store.beat(beat)
    assert store.list_workers() == [beat]
    assert 0 < store.redis.pttl(store.keys.worker("w1")) <= settings.heartbeat_ttl_s * 1000
    store.remove_heartbeat("w1")
    assert store.list_workers() == []


def test_async_store(store: StoreForTests, settings: Settings) -> None:
    async def scenario() -> None:
        astore = AsyncJobStore.from_settings(settings)
        try:
            assert await astore.ping()
            job = await astore.create_job(JobRequest(prompt="hi"), owner="k1")
            assert (await astore.get_record(job.id)).owner == "k1"
            assert await astore.queued_count() == 1
            store.take_job(job.id, "w1", "tiny")
            store.append_batch([run_job(store, ["x", "y"], 1, job.id)])
            assert (await astore.get_job(job.id)).text == "xy"
            assert [e.seq for e in await astore.read_log(job.id, after=1)] == [2]
            state = await astore.stream_state(job.id)
            assert (state.job_id, state.status, state.log_length) == (job.id, JobStatus.RUNNING, 2)
            assert (state.request.prompt, state.created_at, state.model) == ("hi", job.created_at, "tiny")
            assert not state.foreground_and_live
            assert (await astore.request_cancel(job.id)).status is JobStatus.RUNNING
            with pytest.raises(JobNotFound):
                await astore.get_job("nope")
            with pytest.raises(JobNotFound):
                await astore.stream_state("nope")
            waiting = await astore.create_job(JobRequest(prompt="hi", background=False))
            assert (await astore.stream_state(waiting.id)).foreground_and_live
            await astore.request_cancel(waiting.id)  # (off the queue again)
            assert not (await astore.stream_state(waiting.id)).foreground_and_live
            store.beat(WorkerHeartbeat(name="w1", ts=1.0, engine={}, model="tiny"))
            assert [w.name for w in await astore.list_workers()] == ["w1"]
            with pytest.raises(QueueFull):
                for _ in range(settings.max_queued_jobs + 1):
                    await astore.create_job(JobRequest(prompt="x"))
        finally:
            await astore.close()

    asyncio.run(scenario())


def test_a_job_that_ended_at_its_attempt_is_not_lost(store: StoreForTests) -> None:
    """A renewal racing the job's last append: the worker wrote the end, nobody took it over."""
    job = store.create_job(JobRequest(prompt="hello"))
    store.take_job(job.id, "w1", "tiny")
    store.append_batch([Append(job.id, 1, [done(1)], 1, 0, Final(JobStatus.SUCCEEDED, "stop"))])
    assert store.renew_leases({job.id: 1}) == []
    assert (
        store.redis.zscore(store.keys.running_jobs(store.keys.bucket_of(job.id)), job.id) is None
    )  # no lease renewed either
