"""The writer's text checkpoints (docs/internals.md, "Redis"): a text job's text key and counts are
written every TEXT_CHECKPOINT_EVENTS events and at its first and last, and its readers (the job's
view, a take-over's resume) add the log after the checkpoint, so they see what a write at every
step would have shown."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from store_helpers import StoreForTests

from common.schemas.requests import JobRequest
from common.schemas.views import JobStatus
from common.settings import Settings, load_settings
from common.store import TEXT_CHECKPOINT_EVENTS, Append, Appended, Final, TakeStatus, text_read
from workers.appends import JobCursor, prepare_appends
from workers.engine import Delta, FinishReason
from workers.job import new_job

REDIS_URL = "redis://127.0.0.1:6379/0"
WORDS = ["a", "ü", "", "€x", " b"]  # multi-byte, and an event with ids and no text yet


@pytest.fixture
def store(prefixes) -> Iterator[StoreForTests]:  # type: ignore[no-untyped-def]
    settings: Settings = load_settings(redis_url=REDIS_URL, redis_prefix=prefixes.new(), lease_s=30)
    s = StoreForTests.from_settings(settings)
    yield s
    s.close()


def word(step: int) -> str:
    return WORDS[step % len(WORDS)]


def write_steps(store: StoreForTests, cursor: JobCursor, steps: range, last: int = 0) -> None:
    for step in steps:
        reason = FinishReason.LENGTH if step == last else None
        appends = prepare_appends(
            [Delta(cursor.job_id, (step,), word(step), reason, 7, step)], {cursor.job_id: cursor}
        )
        assert store.append_batch(appends) == [Appended.WRITTEN]


def test_a_running_job_reads_its_checkpoint_and_the_log_after_it(store: StoreForTests) -> None:
    job = store.create_job(JobRequest(prompt="hello", max_tokens=100))
    cursor = JobCursor(job.id, store.take_job(job.id, "w1", "m").attempt, 1, 0)
    steps = TEXT_CHECKPOINT_EVENTS + 4
    write_steps(store, cursor, range(1, steps + 1))
    h = store.redis.hgetall(store.keys.job(job.id))
    checkpoint = TEXT_CHECKPOINT_EVENTS + 1  # seq 1, then every TEXT_CHECKPOINT_EVENTS events
    assert int(h["text_seq"]) == checkpoint and int(h["completion_tokens"]) == checkpoint
    saved = "".join(word(s) for s in range(1, checkpoint + 1))
    assert store.redis.get(store.keys.job_text(job.id)) == saved
    assert int(h["text_len"]) == len(saved.encode())
    got = store.get_job(job.id)
    assert got.text == "".join(word(s) for s in range(1, steps + 1))
    assert got.usage.completion_tokens == steps and got.usage.prompt_tokens == 7


def test_a_checkpoint_between_the_reads_is_not_counted_twice(store: StoreForTests) -> None:
    """The hash is read before the text (record_reads): text_len bytes are what text_seq covers,
    whatever a later checkpoint appended meanwhile."""
    h = {"text_seq": "2", "text_len": str(len("aü".encode()))}
    assert text_read(h, "aü€x b", 5) == ("aü", 2)
    assert text_read(h, "aü", 2) == ("aü", 0)
    assert text_read({}, "abc", 3) == ("abc", 0)  # a job with parts: the text at every event
    assert text_read({}, None, 1) is None and text_read({}, None, 0) == ("", 0)


def test_a_take_over_resumes_from_the_checkpoint(store: StoreForTests) -> None:
    job = store.create_job(JobRequest(prompt="hello", max_tokens=100))
    cursor = JobCursor(job.id, store.take_job(job.id, "w1", "m").attempt, 1, 0)
    first = TEXT_CHECKPOINT_EVENTS + 5
    write_steps(store, cursor, range(1, first + 1))
    store.redis.zadd(store.keys.running_jobs(0), {job.id: time.time() - 1})  # w1 died
    taken = store.take_job(job.id, "w2", "m")
    assert taken.status is TakeStatus.TAKEN and taken.text_seq == TEXT_CHECKPOINT_EVENTS + 1
    resumed = new_job(taken).cursor
    assert resumed.unsaved == first - taken.text_seq
    assert resumed.unsaved_text == "".join(word(s) for s in range(taken.text_seq + 1, first + 1))
    # w1 comes back: fenced (one HMGET of the attempts hash says so), w2 goes on to the end.
    write_stale = prepare_appends([Delta(job.id, (0,), "z", None, 7, first + 1)], {job.id: cursor})
    assert store.append_batch(write_stale) == [Appended.FENCED]
    total = first + 2 * TEXT_CHECKPOINT_EVENTS
    write_steps(store, resumed, range(first + 1, total + 1), last=total)
    got = store.get_job(job.id)
    text = "".join(word(s) for s in range(1, total + 1))
    assert got.status is JobStatus.SUCCEEDED and got.text == text and got.usage.completion_tokens == total
    assert store.redis.get(store.keys.job_text(job.id)) == text
    assert store.redis.hget(store.keys.attempts(0), job.id) is None  # dropped with the last append
    # A retry of the last append after a dropped connection: a no-op, not fenced (its attempts
    # entry is gone: the job's hash says whose it was).
    log = store.read_log(job.id)
    last = Append(job.id, resumed.attempt, log[-2:], 7, total, Final(JobStatus.SUCCEEDED, "length"))
    assert store.append_batch([last]) == [Appended.WRITTEN]
    assert store.get_job(job.id).text == text and len(store.read_log(job.id)) == len(log)
