"""Jobs with parts in the store, against the real Redis: one log for all parts, each part fenced
by its own attempt, the job's status from its parts, dependencies, cancel, expiry."""

from __future__ import annotations

import asyncio
import time
from typing import Any, TypeVar

from store_helpers import StoreForTests, every_bucket

from common.keys import part_id
from common.schemas.events import DoneEvent, ErrorEvent, LogEntry
from common.schemas.requests import JobRequest
from common.schemas.views import Job, JobStatus, Usage
from common.settings import Settings
from common.store import Append, Appended, AsyncJobStore, Final, QueueMessage, TakeStatus, token_entry

T = TypeVar("T")

TEXT = {"type": "text", "prompt": "hi", "max_tokens": 4}
IMAGE = {"type": "image", "prompt": "a boat", "size": "32x32", "steps": 2}
MODEL = "m"  # the text parts' model


def run(settings: Settings, op: Any) -> Any:
    """``op(AsyncJobStore)`` on a store of its own event loop (the API's store)."""

    async def go() -> Any:
        store = AsyncJobStore.from_settings(settings)
        try:
            return await op(store)
        finally:
            await store.close()

    return asyncio.run(go())


def create(settings: Settings, parts: list[dict[str, Any]]) -> Job:
    request = JobRequest.accept({"parts": parts}, settings)

    def llm(i):
        queue = settings.keys.model_queue(MODEL)
        return QueueMessage(queue, f"text {i}", queue)

    def media(i, held):
        return QueueMessage(settings.keys.queue_media, f"image {i}" + " held" * held)

    job: Job = run(settings, lambda s: s.create_job(request, "", llm, None, media))
    return job


def get(settings: Settings, job_id: str) -> Job:
    job: Job = run(settings, lambda s: s.get_job(job_id))
    return job


def end_text(store: StoreForTests, pid: str, attempt: int, first: int, status: JobStatus) -> bool:
    usage = Usage.of(2, 1)
    if status is JobStatus.SUCCEEDED:
        terminal = LogEntry.done(first + 1, DoneEvent(status=status, finish_reason="length", usage=usage))
        final = Final(status, "length")
    else:
        terminal = LogEntry.error(first + 1, ErrorEvent(message="boom", type="engine_error"))
        final = Final(status, "error")
    entries = [token_entry(first, first - 1, "tok", [7]), terminal]
    [sent] = store.append_batch([Append(pid, attempt, entries, 2, 1, final)])
    return sent is Appended.WRITTEN


def end_image(store: StoreForTests, pid: str, attempt: int, seq: int, status: JobStatus) -> bool:
    data = {"part": int(pid.rsplit(":", 1)[1]), "status": status.value}
    entry = LogEntry.part_status(seq, data)
    [sent] = store.append_batch([Append(pid, attempt, [entry], 0, 0, Final(status, None), b"\x89PNG")])
    return sent is Appended.WRITTEN


def test_messages_go_to_each_kind_and_a_dependent_waits(store: StoreForTests, settings: Settings) -> None:
    job = create(settings, [TEXT, IMAGE, {**IMAGE, "prompt": None, "prompt_from": 0}])
    r, keys = store.redis, settings.keys
    assert r.lrange(keys.model_queue(MODEL), 0, -1) == [f"text {part_id(job.id, 0)}"]
    # The image is held for the text part's first token (SPOOL_IMAGE_HOLD_S: 2 s by default).
    assert r.lrange(keys.queue_media, 0, -1) == []
    # The text part counts as a queued job (backpressure, the sweep); the job itself never does.
    assert r.zrange(keys.queued_jobs(keys.bucket_of(job.id)), 0, -1) == [part_id(job.id, 0)]
    assert [p["status"] for p in job.parts] == ["queued"] * 3
    # The text part's one append (its token and its end): the held part's message is sent, and
    # the dependent's.
    taken = store.take_job(part_id(job.id, 0), "w", "m")
    assert taken.status is TakeStatus.TAKEN and taken.log == []
    assert end_text(store, part_id(job.id, 0), taken.attempt, 1, JobStatus.SUCCEEDED)
    assert r.lrange(keys.queue_media, 0, -1) == [
        f"image {part_id(job.id, 2)}",
        f"image {part_id(job.id, 1)} held",
    ]
    assert store.part_text(job.id, 0) == "tok"


def test_a_held_image_part_is_sent_once_every_text_part_has_its_first_token(
    store: StoreForTests, settings: Settings
) -> None:
    """Its message waits for each text part's first event (a token, or its end before any)."""
    job = create(settings, [TEXT, IMAGE, TEXT, {**IMAGE, "prompt": None, "prompt_from": 0}])
    r, keys = store.redis, settings.keys
    texts, image = [part_id(job.id, 0), part_id(job.id, 2)], part_id(job.id, 1)
    assert r.zrange(keys.held_media(keys.bucket_of(job.id)), 0, -1, withscores=True) == [
        (image, job.created_at + 2.0)
    ]
    first = store.take_job(texts[0], "w", "m")
    token = token_entry(1, 0, "tok", [7])
    assert store.append_batch([Append(texts[0], first.attempt, [token], 2, 1)]) == [Appended.WRITTEN]
    assert r.llen(keys.queue_media) == 0  # part 2 has none yet
    # Part 0's next tokens, and a take-over of it, count nothing more.
    more = token_entry(2, 1, "tok", [7])
    assert store.append_batch([Append(texts[0], first.attempt, [more], 2, 2)]) == [Appended.WRITTEN]
    other = store.take_job(texts[1], "w", "m")
    error = LogEntry.error(1, ErrorEvent(message="boom", type="engine_error"))
    assert store.append_batch(
        [Append(texts[1], other.attempt, [error], 2, 0, Final(JobStatus.FAILED, "error"))]
    )
    assert r.lrange(keys.queue_media, 0, -1) == [f"image {image} held"]
    assert r.zcard(keys.held_media(keys.bucket_of(job.id))) == 0 and r.zrange(
        keys.queued_media(keys.bucket_of(job.id)), 0, -1
    ) == [image]
    assert get(settings, job.id).parts[1]["status"] == "queued"  # queued until a media worker takes it
    taken = store.take_job(image, "m1", "sd")
    assert taken.record is not None and taken.record.released_at is not None
    assert taken.record.released_at >= job.created_at
    assert store.release_held(time.time() + 60) is None  # nothing left to send
    assert r.llen(keys.queue_media) == 1


def test_a_held_image_part_is_sent_at_its_bound(store: StoreForTests, settings: Settings) -> None:
    """No first token: the media workers' check sends it SPOOL_IMAGE_HOLD_S after the job's
    creation, or at its timeout_s when that comes first; a cancelled one is never sent."""
    r, keys = store.redis, settings.keys
    job = create(settings, [TEXT, IMAGE])
    soon = create(settings, [TEXT, {**IMAGE, "timeout_s": 0.5}])
    gone = create(settings, [TEXT, IMAGE])
    run(settings, lambda s: s.request_cancel(gone.id))
    image, early = part_id(job.id, 1), part_id(soon.id, 1)
    held = [keys.held_media(b) for b in keys.bucket_range()]
    assert every_bucket(r, held) == [early, image]  # the cancel took its own out
    bound = job.created_at + 2.0
    assert store.release_held(soon.created_at + 0.4) == soon.created_at + 0.5  # none due yet
    assert r.llen(keys.queue_media) == 0
    assert store.release_held(soon.created_at + 0.5) == bound
    assert r.lrange(keys.queue_media, 0, -1) == [f"image {early} held"]
    assert store.release_held(bound) is None
    assert r.lrange(keys.queue_media, 0, -1) == [f"image {image} held", f"image {early} held"]
    # Its text part's first token then sends nothing more.
    t = store.take_job(part_id(job.id, 0), "w", "m")
    assert end_text(store, part_id(job.id, 0), t.attempt, 1, JobStatus.SUCCEEDED)
    assert r.llen(keys.queue_media) == 2


def test_one_log_consecutive_ids_and_the_job_status_from_its_parts(
    store: StoreForTests, settings: Settings
) -> None:
    job = create(settings, [TEXT, IMAGE])
    text, image = part_id(job.id, 0), part_id(job.id, 1)
    t = store.take_job(text, "w", "m")
    i = store.take_job(image, "m1", "sd")
    assert get(settings, job.id).status is JobStatus.RUNNING
    progress = LogEntry.progress(1, 1, 1, 2)
    assert store.append_batch([Append(image, i.attempt, [progress], 0, 0)]) == [Appended.WRITTEN]
    assert end_text(store, text, t.attempt, 1, JobStatus.SUCCEEDED)
    assert end_image(store, image, i.attempt, 2, JobStatus.FAILED)
    log = store.read_log(job.id)
    assert [e.seq for e in log] == list(range(1, len(log) + 1))
    assert [(e.type, e.data.get("part")) for e in log] == [
        ("part", 0),
        ("part", 1),
        ("progress", 1),
        ("token", 0),
        ("part", 0),
        ("part", 1),
        ("done", None),
    ]
    done = log[-1].data
    assert done["status"] == "partial"
    assert [p["status"] for p in done["parts"]] == ["succeeded", "failed"]
    final = get(settings, job.id)
    assert final.status is JobStatus.PARTIAL and final.text == "tok"
    assert [p["status"] for p in final.parts] == ["succeeded", "failed"]
    # Everything expires with the job.
    for key in (settings.keys.job(job.id), settings.keys.job_log(job.id), settings.keys.job(image)):
        assert 0 < store.redis.ttl(key) <= settings.job_ttl_s


def test_a_part_is_fenced_by_its_own_attempt_and_appends_are_idempotent(
    store: StoreForTests, settings: Settings
) -> None:
    job = create(settings, [IMAGE])
    pid = part_id(job.id, 0)
    first = store.take_job(pid, "m1", "sd")
    step = Append(pid, first.attempt, [LogEntry.progress(1, 0, 1, 2)], 0, 0)
    assert store.append_batch([step]) == [Appended.WRITTEN]
    assert store.append_batch([step]) == [Appended.WRITTEN]  # a retry of an append applied: no duplicate
    # Its worker died: the lease lapses and another takes the part over (a new attempt).
    store.redis.zadd(settings.keys.running_jobs(settings.keys.bucket_of(job.id)), {pid: time.time() - 1})
    second = store.take_job(pid, "m2", "sd")
    assert second.status is TakeStatus.TAKEN and second.attempt == first.attempt + 1
    assert [e.seq for e in second.log] == [1]  # the part's own events, numbered as it counts them
    # The stale worker can no longer write; the new one goes on after the part's own count.
    assert store.append_batch([Append(pid, first.attempt, [LogEntry.progress(2, 0, 2, 2)], 0, 0)]) == [
        Appended.FENCED
    ]
    assert end_image(store, pid, second.attempt, 2, JobStatus.SUCCEEDED)
    log = store.read_log(job.id)
    assert [e.seq for e in log] == [1, 2, 3, 4, 5]
    assert [e.data.get("attempt") for e in log if e.type == "part" and e.data["status"] == "running"] == [
        1,
        2,
    ]
    assert log[-1].data["status"] == "succeeded"


def test_a_failed_text_part_fails_its_dependents(store: StoreForTests, settings: Settings) -> None:
    job = create(settings, [TEXT, {**IMAGE, "prompt": None, "prompt_from": 0}])
    t = store.take_job(part_id(job.id, 0), "w", "m")
    assert end_text(store, part_id(job.id, 0), t.attempt, 1, JobStatus.FAILED)
    final = get(settings, job.id)
    assert final.status is JobStatus.FAILED
    assert final.parts[1]["error"]["type"] == "dependency_failed"
    assert store.redis.llen(settings.keys.queue_media) == 0
    log = store.read_log(job.id)
    assert log[-2].data["error"]["type"] == "dependency_failed" and log[-1].type == "done"


def test_cancel_ends_queued_parts_at_once_and_asks_running_ones(
    store: StoreForTests, settings: Settings
) -> None:
    job = create(settings, [TEXT, IMAGE])
    image = part_id(job.id, 1)
    i = store.take_job(image, "m1", "sd")
    cancelled = run(settings, lambda s: s.request_cancel(job.id))
    assert cancelled.status is JobStatus.RUNNING  # the running part ends at its worker's next step
    assert [p["status"] for p in cancelled.parts] == ["cancelled", "running"]
    assert store.cancel_requested([image]) == [image]
    assert store.take_job(part_id(job.id, 0), "w", "m").status is TakeStatus.FINISHED
    assert end_image(store, image, i.attempt, 1, JobStatus.CANCELLED)
    done = store.read_log(job.id)[-1]
    assert done.type == "done" and done.data["status"] == "cancelled"
    assert get(settings, job.id).status is JobStatus.CANCELLED


def test_image_content_is_binary_safe(store: StoreForTests, settings: Settings) -> None:
    job = create(settings, [IMAGE])
    pid = part_id(job.id, 0)
    i = store.take_job(pid, "m1", "sd")
    assert run(settings, lambda s: s.part_content(job.id, 0)) is None  # not before it succeeded
    assert end_image(store, pid, i.attempt, 1, JobStatus.SUCCEEDED)
    assert run(settings, lambda s: s.part_content(job.id, 0)) == b"\x89PNG"


def test_image_parts_whose_message_was_sent_are_swept_for_a_lost_one(
    store: StoreForTests, settings: Settings
) -> None:
    """{p}:queued_media holds an image part from its message's push to its take (or cancel); the
    media sweep finds it stale only while the media queue is empty (its message was lost)."""
    settings = settings.model_copy(update={"image_hold_s": 0.0})  # no hold: sent at once
    job = create(settings, [TEXT, IMAGE, {**IMAGE, "prompt": None, "prompt_from": 0}])
    r, keys, media = store.redis, settings.keys, settings.keys.queue_media
    text, image, dependent = (part_id(job.id, k) for k in range(3))
    assert r.zrange(keys.queued_media(keys.bucket_of(job.id)), 0, -1) == [
        image
    ]  # the dependent has no message yet
    later = time.time() + 60
    llm = keys.model_queue(MODEL)
    assert store.stale_queued(later, media) == []  # its message is still in the queue
    r.delete(*keys.queue_lists(media))  # lost (e.g. a Redis restart without it)
    assert store.stale_queued(later, media) == [image]
    assert store.stale_queued(later, llm) == []  # the text part's message is still in its queue
    r.delete(*keys.queue_lists(llm))
    assert store.stale_queued(later, llm) == [text]  # the text sweep sees only text jobs and parts
    assert store.stale_queued(later, keys.model_queue("another")) == []  # and of its model
    assert store.claim_requeue(image, later, 10, media)
    assert not store.claim_requeue(image, later, 10, media)  # once per gap
    # The text part succeeds: the dependent's message is sent, and it is queued from then on.
    taken = store.take_job(text, "w", "m")
    assert end_text(store, text, taken.attempt, 1, JobStatus.SUCCEEDED)
    assert r.zrange(keys.queued_media(keys.bucket_of(job.id)), 0, -1) == [image, dependent]
    assert store.take_job(image, "m1", "sd").status is TakeStatus.TAKEN
    assert r.zrange(keys.queued_media(keys.bucket_of(job.id)), 0, -1) == [dependent]
    store.request_cancel(job.id)
    assert r.zcard(keys.queued_media(keys.bucket_of(job.id))) == 0


def test_the_parts_of_a_foreground_job_say_so(store: StoreForTests, settings: Settings) -> None:
    request = JobRequest.accept({"parts": [TEXT, IMAGE], "background": False}, settings)
    job: Job = run(settings, lambda s: s.create_job(request, "", None, None, None))
    text = store.take_job(part_id(job.id, 0), "w", "m")
    image = store.take_job(part_id(job.id, 1), "m1", "sd")
    assert text.record is not None and image.record is not None
    assert image.record.foreground_parent and text.record.foreground_parent
    assert isinstance(text.record.request, JobRequest) and not text.record.request.background
    # A part counts its job's watchers: nobody watches this one.
    now = time.time()
    assert store.unwatched([part_id(job.id, 1)], 0.0) == [part_id(job.id, 1)]
    store.redis.zadd(settings.keys.job_watchers(job.id), {"w1": now + 30})
    assert store.unwatched([part_id(job.id, 1)], 0.0) == []
