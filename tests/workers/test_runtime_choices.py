"""Jobs with n > 1 choices in the EngineRuntime (real engine, tiny model, real Redis): the log
contract with choices, per-choice seeds, usage summed, cancel, and a take-over that resumes each
choice from its own stored tokens."""

from __future__ import annotations

import time
from collections import defaultdict

from store_helpers import StoreForTests
from test_runtime import LONG_PROMPT, check_log, poll, run_in_thread

from common.schemas.events import LogEntry
from common.schemas.requests import JobRequest
from common.schemas.views import JobStatus
from common.store import Append, Appended, token_entry
from workers.engine import Engine, SamplingParams
from workers.job import choice_seed
from workers.runtime import EngineRuntime
from workers.task_common import Outcome


def by_choice(log: list[LogEntry]) -> dict[int, list[LogEntry]]:
    out: dict[int, list[LogEntry]] = defaultdict(list)
    for e in log:
        if e.type == "token":
            out[e.data["choice"]].append(e)
    return out


def ids_of(entries: list[LogEntry]) -> list[int]:
    return [i for e in entries for i in e.data["token_ids"]]


def test_choices_follow_their_seeds_and_usage_is_summed(
    runtime: EngineRuntime, store: StoreForTests, reference: Engine
) -> None:
    request = JobRequest(prompt=LONG_PROMPT, max_tokens=12, temperature=1.0, seed=42, n=3)
    job = store.create_job(request)
    assert runtime.run_job(job.id) is Outcome.FINISHED
    got = store.get_job(job.id)
    log = check_log(store, got)
    choices = by_choice(log)
    assert sorted(choices) == [0, 1, 2]
    # Each choice is the request alone with seed + index, whatever else is in the batch.
    for k, entries in choices.items():
        alone = reference.generate(
            [LONG_PROMPT], SamplingParams(max_tokens=12, temperature=1.0, seed=choice_seed(42, k))
        )[0]
        assert ids_of(entries) == alone.token_ids
        reasons = [e.data.get("finish_reason") for e in entries]
        assert reasons == [None] * (len(entries) - 1) + [alone.finish_reason.value]  # type: ignore[union-attr]
    assert got.text == "".join(e.data["text"] for e in choices[0])  # the job's text is choice 0's
    total = sum(len(ids_of(e)) for e in choices.values())
    assert got.usage.completion_tokens == total and log[-1].data["usage"]["completion_tokens"] == total
    assert got.usage.prompt_tokens == len(reference.tokenizer.encode(LONG_PROMPT))  # counted once
    assert got.status is JobStatus.SUCCEEDED and got.finish_reason == choices[0][-1].data["finish_reason"]


def test_cancel_ends_every_choice(runtime: EngineRuntime, store: StoreForTests) -> None:
    job = store.create_job(JobRequest(prompt=LONG_PROMPT, max_tokens=400, temperature=0, n=2))
    thread, outcomes = run_in_thread(runtime, job.id)
    poll(lambda: len(store.read_log(job.id)) >= 4, "a few tokens")
    store.request_cancel(job.id)
    thread.join(30)
    assert outcomes == [Outcome.FINISHED]
    got = store.get_job(job.id)
    log = check_log(store, got)
    assert got.status is JobStatus.CANCELLED and log[-1].data["status"] == "cancelled"
    assert {k: e[-1].data["finish_reason"] for k, e in by_choice(log).items()} == {
        0: "cancelled",
        1: "cancelled",
    }
    assert 0 < got.usage.completion_tokens < 800


def test_takeover_resumes_each_choice_from_its_own_tokens(
    runtime: EngineRuntime, store: StoreForTests
) -> None:
    request = JobRequest(prompt=LONG_PROMPT, max_tokens=10, temperature=1.0, seed=7, n=3)
    whole = store.create_job(request)
    assert runtime.run_job(whole.id) is Outcome.FINISHED
    whole_choices = by_choice(store.read_log(whole.id))
    want = {k: ids_of(e) for k, e in whole_choices.items()}

    job = store.create_job(request)
    # A worker that wrote 4 events of choice 0, all of choice 1 (ended), 2 of choice 2, and died
    # (its events as the unbroken run wrote them: the texts its detokenizer let out).
    first = store.take_job(job.id, "dead-worker", "m")
    written = [(0, whole_choices[0][:4]), (1, whole_choices[1]), (2, whole_choices[2][:2])]
    entries = []
    for k, events in written:
        for e in events:
            i = len(entries)
            entries.append(
                token_entry(
                    i + 1,
                    i,
                    e.data["text"],
                    e.data["token_ids"],
                    choice=k,
                    finish_reason=e.data.get("finish_reason"),
                )
            )
    resumed = sum(len(ids_of(events)) for _, events in written)
    assert store.append_batch([Append(job.id, first.attempt, entries, 3, resumed)]) == [Appended.WRITTEN]
    store.redis.zadd(store.keys.running_jobs(0), {job.id: time.time() - 1})
    assert runtime.run_job(job.id) is Outcome.FINISHED
    got = store.get_job(job.id)
    log = check_log(store, got)
    choices = by_choice(log)
    # The seeded streams skip what each choice had drawn: the same tokens as the unbroken run.
    assert {k: ids_of(e) for k, e in choices.items()} == want
    assert len(choices[1]) == len(whole_choices[1])  # ended: not run again
    assert got.usage.completion_tokens == sum(map(len, want.values()))
    assert got.status is JobStatus.SUCCEEDED and store.get_record(job.id).attempt == 2


def test_the_request_gauges_count_a_job_with_choices_once(
    runtime: EngineRuntime, store: StoreForTests
) -> None:
    """spool_num_requests_running / _waiting count jobs, not their choices (docs/metrics.md)."""
    slots = runtime.engine.num_slots
    first = store.create_job(JobRequest(prompt=LONG_PROMPT, max_tokens=400, temperature=0, n=slots))
    second = store.create_job(JobRequest(prompt=LONG_PROMPT, max_tokens=400, temperature=0, n=2))
    threads = [run_in_thread(runtime, first.id)[0]]
    poll(lambda: len(store.read_log(first.id)) >= slots, "the first job's tokens")  # every slot held
    threads.append(run_in_thread(runtime, second.id)[0])

    def gauges() -> tuple[float | None, float | None]:
        return tuple(  # type: ignore[return-value]
            runtime.metrics.registry.get_sample_value(
                f"spool_num_requests_{g}", {"model_name": runtime.metrics.model_name}
            )
            for g in ("running", "waiting")
        )

    # The engine holds 8 + 2 requests: the first job's choices in every slot, the second's waiting.
    poll(lambda: runtime.engine.stats()["waiting"] == 2, "the second job in the engine")
    assert poll(lambda: gauges() == (1, 1) or None, "one job running and one waiting")
    for job in (first, second):
        store.request_cancel(job.id)
    for t in threads:
        t.join(30)
    assert poll(lambda: gauges() == (0, 0) or None, "no job left")
