"""EngineRuntime with the real engine (tiny model) and the real Redis."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from procs import REDIS_URL
from store_helpers import StoreForTests

from common.schemas.chat import ChatMessage
from common.schemas.events import LogEntry
from common.schemas.requests import JobRequest
from common.schemas.views import Job, JobStatus
from common.settings import load_settings
from common.store import Append, Appended, QueueMessage, token_entry
from workers.engine import Engine, SamplingParams
from workers.job import prompt_of
from workers.liveness import HeldJob
from workers.runtime import EngineRuntime
from workers.task_common import Outcome

LONG_PROMPT = "the quick brown fox"  # greedy on the tiny model runs to max_tokens (no EOS)


def poll(check: Callable[[], object], what: str, timeout: float = 30.0) -> object:
    """Poll ``check`` until it returns something truthy, and return it; fail at the deadline."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.01)
    return result


def greedy(engine: Engine, prompt: str, max_tokens: int) -> tuple[str, list[int]]:
    out = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]
    return out.text, out.token_ids


def check_log(store: StoreForTests, job: Job) -> list[LogEntry]:
    """The log contract: seqs 1..n, token indexes 0..k-1, one terminal event, last."""
    log = store.read_log(job.id)
    assert [e.seq for e in log] == list(range(1, len(log) + 1))
    tokens = [e for e in log if e.type == "token"]
    assert [e.data["index"] for e in tokens] == list(range(len(tokens)))
    assert [e.terminal for e in log] == [False] * (len(log) - 1) + [True]
    return log


def run_in_thread(runtime: EngineRuntime, job_id: str) -> tuple[threading.Thread, list[Outcome]]:
    outcomes: list[Outcome] = []
    t = threading.Thread(target=lambda: outcomes.append(runtime.run_job(job_id)))
    t.start()
    return t, outcomes


def test_job_runs_to_its_greedy_output(
    runtime: EngineRuntime, store: StoreForTests, reference: Engine
) -> None:
    job = store.create_job(JobRequest(prompt=LONG_PROMPT, max_tokens=24, temperature=0))
    assert runtime.run_job(job.id) is Outcome.FINISHED
    got = store.get_job(job.id)
    text, ids = greedy(reference, LONG_PROMPT, 24)
    assert got.status is JobStatus.SUCCEEDED and got.finish_reason == "length"
    assert got.text == text and got.usage.completion_tokens == 24 and got.usage.prompt_tokens > 0
    assert got.model and got.started_at and got.finished_at
    log = check_log(store, got)
    assert [i for e in log if e.type == "token" for i in e.data["token_ids"]] == ids
    assert log[-1].data["usage"] == got.usage.model_dump()
    assert store.redis.ttl(store.keys.job_log(job.id)) > 0
    assert runtime.run_job(job.id) is Outcome.SKIPPED  # a redelivered message


def test_concurrent_jobs_share_the_batch(
    runtime: EngineRuntime, store: StoreForTests, reference: Engine
) -> None:
    prompts = [f"{LONG_PROMPT} {i}" for i in range(6)]
    jobs = [store.create_job(JobRequest(prompt=p, max_tokens=30, temperature=0)) for p in prompts]
    with ThreadPoolExecutor(len(jobs)) as pool:
        outcomes = list(pool.map(lambda j: runtime.run_job(j.id), jobs))
    assert outcomes == [Outcome.FINISHED] * len(jobs)
    for prompt, job in zip(prompts, jobs, strict=True):
        got = store.get_job(job.id)
        assert got.status is JobStatus.SUCCEEDED and got.text == greedy(reference, prompt, 30)[0]
        check_log(store, got)
    beat = poll(
        lambda: [w for w in store.list_workers() if w.engine.get("peak_batch_size", 0) > 1], "a batched step"
    )
    assert beat[0].name == "test-worker"  # type: ignore[index]


def test_chat_messages(runtime: EngineRuntime, store: StoreForTests) -> None:
    request = JobRequest(
        messages=[ChatMessage(role="user", content="hello there")], max_tokens=8, temperature=0
    )
    job = store.create_job(request)
    assert runtime.run_job(job.id) is Outcome.FINISHED
    assert store.get_job(job.id).status is JobStatus.SUCCEEDED


def test_messages_without_a_chat_template_are_refused(runtime: EngineRuntime) -> None:
    # The API refuses these when a worker tells it the model has no template; a job queued
    # before any worker was up still meets a worker that renders no made-up format.
    tokenizer = copy.copy(runtime.engine.tokenizer)
    tokenizer.chat_template = None
    request = JobRequest(messages=[ChatMessage(role="user", content="hi")], max_tokens=4)
    with pytest.raises(ValueError, match="no chat template"):
        prompt_of(request, tokenizer)


def test_cancel_a_running_job(runtime: EngineRuntime, store: StoreForTests) -> None:
    job = store.create_job(JobRequest(prompt=LONG_PROMPT, max_tokens=400, temperature=0))
    thread, outcomes = run_in_thread(runtime, job.id)
    poll(lambda: store.read_log(job.id), "a first token")
    store.request_cancel(job.id)
    thread.join(30)
    assert outcomes == [Outcome.FINISHED]
    got = store.get_job(job.id)
    assert got.status is JobStatus.CANCELLED and got.finish_reason == "cancelled"
    assert 0 < got.usage.completion_tokens < 400
    assert check_log(store, got)[-1].data["status"] == "cancelled"


def test_missed_cancel_message_is_caught_by_the_heartbeat(
    runtime: EngineRuntime, store: StoreForTests
) -> None:
    job = store.create_job(JobRequest(prompt=LONG_PROMPT, max_tokens=400, temperature=0))
    thread, outcomes = run_in_thread(runtime, job.id)
    poll(lambda: store.read_log(job.id), "a first token")
    store.redis.hset(store.keys.job(job.id), "cancel_requested", "1")  # the flag without the message
    thread.join(30)
    assert outcomes == [Outcome.FINISHED] and store.get_job(job.id).status is JobStatus.CANCELLED


def test_job_cancelled_while_queued_never_reaches_the_engine(
    runtime: EngineRuntime, store: StoreForTests
) -> None:
    job = store.create_job(JobRequest(prompt="hello", max_tokens=8))
    store.request_cancel(job.id)
    assert runtime.run_job(job.id) is Outcome.SKIPPED
    assert len(store.read_log(job.id)) == 1


def test_too_long_request_fails_with_the_engine_message(runtime: EngineRuntime, store: StoreForTests) -> None:
    job = store.create_job(JobRequest(prompt="hello", max_tokens=4000))
    assert runtime.run_job(job.id) is Outcome.FINISHED
    got = store.get_job(job.id)
    assert got.status is JobStatus.FAILED and got.error is not None
    assert got.error.type == "request_too_long" and "max_model_len" in got.error.message
    last = check_log(store, got)[-1]
    assert last.type == "error" and last.data == {"status": "failed", **got.error.model_dump()}


def test_timeout_before_the_engine(runtime: EngineRuntime, store: StoreForTests) -> None:
    job = store.create_job(JobRequest(prompt="hello", max_tokens=8, timeout_s=0.01))
    poll(lambda: time.time() > job.created_at + 0.01, "the deadline")
    assert runtime.run_job(job.id) is Outcome.FINISHED
    got = store.get_job(job.id)
    assert got.status is JobStatus.FAILED and got.error is not None and got.error.type == "timeout"
    assert got.finish_reason == "timeout"


def test_timeout_in_the_engine(runtime: EngineRuntime, store: StoreForTests, reference: Engine) -> None:
    # A quarter of the time the whole generation takes here, so the deadline falls mid-way.
    started = time.monotonic()
    greedy(reference, LONG_PROMPT, 400)
    timeout = (time.monotonic() - started) / 4
    job = store.create_job(JobRequest(prompt=LONG_PROMPT, max_tokens=400, temperature=0, timeout_s=timeout))
    assert runtime.run_job(job.id) is Outcome.FINISHED
    got = store.get_job(job.id)
    assert got.status is JobStatus.FAILED and got.error is not None and got.error.type == "timeout"
    assert got.finish_reason == "timeout"
    assert got.finished_at is not None and got.finished_at >= job.created_at + timeout
    assert got.usage.completion_tokens < 400
    check_log(store, got)


def test_takeover_resumes_from_the_stored_tokens(
    runtime: EngineRuntime, store: StoreForTests, reference: Engine
) -> None:
    text, ids = greedy(reference, LONG_PROMPT, 20)
    # A cut after which the text so far is final (no UTF-8 sequence split across it).
    decode = reference.tokenizer.decode
    k = next(
        k for k in range(7, 15) if text.startswith(decode(ids[:k])) and not decode(ids[:k]).endswith("\ufffd")
    )
    job = store.create_job(JobRequest(prompt=LONG_PROMPT, max_tokens=20, temperature=0))
    # A worker that wrote k tokens and died: its lease lapses.
    first = store.take_job(job.id, "dead-worker", "m")
    entries = [token_entry(1, 0, decode(ids[:k]), ids[:k])]
    assert store.append_batch([Append(job.id, first.attempt, entries, 3, k)]) == [Appended.WRITTEN]
    store.redis.zadd(store.keys.running_jobs(0), {job.id: time.time() - 1})
    assert runtime.run_job(job.id) is Outcome.FINISHED
    got = store.get_job(job.id)
    log = check_log(store, got)
    assert [i for e in log if e.type == "token" for i in e.data["token_ids"]] == ids
    assert got.text == text  # nothing repeated, nothing lost
    assert got.status is JobStatus.SUCCEEDED and got.finish_reason == "length"
    assert got.usage.completion_tokens == 20 and store.get_record(job.id).attempt == 2


def test_a_job_taken_over_is_dropped(runtime: EngineRuntime, store: StoreForTests) -> None:
    job = store.create_job(JobRequest(prompt=LONG_PROMPT, max_tokens=400, temperature=0))
    thread, outcomes = run_in_thread(runtime, job.id)
    poll(lambda: store.read_log(job.id), "a first token")

    def take_over() -> bool:
        # Lapse the lease and take the job; the runtime's heartbeat may renew it in between.
        store.redis.zadd(store.keys.running_jobs(0), {job.id: time.time() - 1})
        return store.take_job(job.id, "other-worker", "m").attempt == 2

    poll(take_over, "a take-over by another worker")
    thread.join(30)
    assert outcomes == [Outcome.LOST]
    n = len(store.read_log(job.id))
    poll(lambda: runtime.job_ids() == [], "the runtime to forget the job")
    assert len(store.read_log(job.id)) == n  # fenced: nothing more from the old attempt
    assert store.get_record(job.id).worker == "other-worker"


def test_heartbeat_names_the_model(runtime: EngineRuntime, store: StoreForTests) -> None:
    beat = poll(lambda: store.list_workers(), "a heartbeat")
    assert beat[0].model and "peak_batch_size" in beat[0].engine  # type: ignore[index]


def test_a_gap_in_the_log_hands_the_job_back(
    runtime: EngineRuntime, store: StoreForTests, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gap (an entry of this worker's missing: a write that was skipped) is no take-over: the
    attempt is still this worker's. It stops the job and lapses its lease at once, so the sweep
    requeues it and a take-over resumes from what is stored (before: dropped as "taken over by
    another worker", its lease left to lapse unrenewed).

    A heartbeat that read the job held before the hand-back renews no lease after it lapsed: it
    is held here between the two, and the hand-back waits for it (before: the lease was renewed
    a whole lease on, now and then, and this test failed)."""
    job = store.create_job(JobRequest(prompt=LONG_PROMPT, max_tokens=400, temperature=0))
    read, go, handing_back = threading.Event(), threading.Event(), threading.Event()
    outcomes: list[Outcome] = []

    def run() -> None:
        outcomes.append(runtime.run_job(job.id))
        handing_back.set()  # the hand-back did not wait

    def held() -> dict[str, HeldJob]:
        jobs = EngineRuntime.held(runtime)
        if threading.current_thread() is beat:
            read.set()
            go.wait(30)
        return jobs

    class Leases:  # the lease lock, telling when the writer's hand-back waits for it
        lock = runtime.liveness.leases

        def __enter__(self) -> None:
            if threading.current_thread().name == "spool-writer":
                handing_back.set()
            self.lock.acquire()

        def __exit__(self, *exc: object) -> None:
            self.lock.release()

    monkeypatch.setattr(runtime, "held", held)
    monkeypatch.setattr(runtime.liveness, "leases", Leases())
    thread = threading.Thread(target=run)
    thread.start()
    poll(lambda: len(store.read_log(job.id)) >= 3, "a few tokens")
    beat = threading.Thread(target=runtime.liveness.beat_once)
    beat.start()
    assert read.wait(30)  # the beat read the job held, and has not renewed its lease yet
    store.redis.rpop(store.keys.job_log(job.id))
    assert handing_back.wait(30)
    go.set()
    beat.join(30)
    thread.join(30)
    assert outcomes == [Outcome.LOST]
    assert store.get_record(job.id).attempt == 1
    lease = store.redis.zscore(store.keys.running_jobs(0), job.id)
    assert lease is not None and lease <= time.time()  # lapsed now, not a lease from now


def test_the_worker_sets_its_torch_threads(prefixes, tiny_model) -> None:  # type: ignore[no-untyped-def]
    """SPOOL_TORCH_THREADS is applied before the engine loads (spool up sets it: cores minus one)."""
    before = torch.get_num_threads()
    settings = load_settings(
        redis_url=REDIS_URL, redis_prefix=prefixes.new(), model=str(tiny_model), torch_threads=1
    )
    try:
        rt = EngineRuntime.from_settings(settings, "threads-worker")
        rt.close()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_worker_holding_batch_lines_takes_a_queued_interactive_job_itself(
    runtime: EngineRuntime, store: StoreForTests, reference: Engine
) -> None:
    # A batch's line (batch_feed.lua marks its hash with the batch), run as its Celery task would.
    line = store.create_job(JobRequest(prompt=LONG_PROMPT, max_tokens=400, temperature=0))
    store.redis.zrem(store.keys.queued_jobs(0), line.id)  # lines are never in the queued set
    store.redis.hset(store.keys.job(line.id), "batch", "batch_test")
    thread, outcomes = run_in_thread(runtime, line.id)
    poll(lambda: store.read_log(line.id), "the line's first token")
    # An interactive job whose message no task thread takes (all of them hold lines, as far as
    # Celery is concerned): the runtime's intake takes it from the queued set.
    # (Of this worker's model: its intake takes no other model's jobs.)
    sent = QueueMessage(f"{runtime.queue}:sent", "", runtime.queue)  # in no list the worker reads
    job = store.create_job(
        JobRequest(prompt="hello", max_tokens=8, temperature=0), message_for=lambda _: sent
    )
    done = poll(lambda: (j := store.get_job(job.id)).status.terminal and j, "the interactive job to end")
    assert done.status is JobStatus.SUCCEEDED  # type: ignore[attr-defined]
    assert done.text == greedy(reference, "hello", 8)[0]  # type: ignore[attr-defined]
    assert store.get_job(line.id).status is JobStatus.RUNNING  # taken while the line ran
    assert runtime.run_job(job.id) is Outcome.SKIPPED  # its message, delivered later, is dropped
    store.request_cancel(line.id)
    thread.join(30)
    assert outcomes == [Outcome.FINISHED] and store.get_job(line.id).status is JobStatus.CANCELLED
    check_log(store, store.get_job(job.id))


def test_the_tokenizer_spec_lives_while_a_worker_names_it(prefixes, tiny_model) -> None:  # type: ignore[no-untyped-def]
    """Stored before the first heartbeat with the heartbeat's TTL, every beat of any worker that
    names it sets it again (stores it again once lost), and it goes after the last one stopped."""
    settings = load_settings(
        redis_url=REDIS_URL,
        redis_prefix=prefixes.new(),
        model=str(tiny_model),
        heartbeat_s=0.1,
        heartbeat_ttl_s=1,
    )
    store = StoreForTests.from_settings(settings)
    one = EngineRuntime.from_settings(settings, "tok-one")
    two = EngineRuntime.from_settings(settings, "tok-two")
    try:
        poll(lambda: len(store.list_workers()) == 2, "two heartbeats")
        digests = {b.tokenizer for b in store.list_workers()}
        assert len(digests) == 1 and None not in digests
        key = store.keys.tokenizer(str(digests.pop()))

        def refreshed() -> bool:
            before = store.redis.pttl(key)
            assert 0 < before <= 1000  # it expires (-1: none; -2: gone)
            return bool(poll(lambda: store.redis.pttl(key) > before, "the spec's expiry set again"))

        refreshed()
        store.redis.delete(key)  # as a Redis restarted empty would have it
        poll(lambda: store.redis.exists(key), "the spec stored again by a beat")
        one.close()
        refreshed()  # the other worker keeps it
    finally:
        one.close()
        two.close()
    poll(lambda: not store.redis.exists(key), "the spec gone with the last worker naming it", timeout=10)
    store.close()
