"""workers/job.py on its own: a job's choices rebuilt from its log, its sampling parameters, and the
deltas that end it before (or without) the engine. Pure: no Redis, no engine, no threads."""

from __future__ import annotations

import time

from common.schemas.requests import JobRequest
from common.schemas.views import JobError
from common.store import token_entry
from workers.appends import JobCursor
from workers.engine import FinishReason
from workers.job import (
    Job,
    choice_seed,
    choices_of,
    choices_to_run,
    end_deltas,
    guide_name,
    refused,
    sampling_params,
)


def make_job(
    request: JobRequest, resumed: dict[int, list[int]] | None = None, finished: frozenset[int] = frozenset()
) -> Job:
    """A job as new_job builds it for ``request`` whose earlier attempts logged ``resumed`` (choice ->
    token ids), the choices in ``finished`` with their last event."""
    resumed = resumed or {}
    log = [
        token_entry(i + 1, i, "x" * len(ids), ids, choice=k if request.n > 1 else None,
                    finish_reason="length" if k in finished else None)
        for i, (k, ids) in enumerate(sorted(resumed.items()))
    ]  # fmt: skip
    choices = choices_of("j", request.n, log, "".join(e.data["text"] for e in log))
    cursor = JobCursor("j", attempt=1, next_seq=len(log) + 1, next_index=len(log))
    if request.n > 1:
        cursor.choice_of = {c.engine_id: c.index for c in choices}
        cursor.generated = {c.index: len(c.resume_token_ids) for c in choices}
        cursor.live = {c.index for c in choices if not c.finished}
    return Job(cursor, request, choices, "owner", False, None, time.time())


def test_one_choice_resumes_with_every_logged_token_and_the_stored_text() -> None:
    log = [token_entry(1, 0, "ab", [1, 2]), token_entry(2, 1, "", [3])]
    (only,) = choices_of("j", 1, log, "ab")
    assert (only.index, only.engine_id, only.resume_token_ids, only.resume_text) == (0, "j", [1, 2, 3], "ab")
    assert not only.finished


def test_choices_resume_each_from_their_own_tokens_and_only_stop_or_length_ends_one() -> None:
    log = [
        token_entry(1, 0, "a", [1], choice=0),
        token_entry(2, 1, "b", [2], choice=1, finish_reason="stop"),
        token_entry(3, 2, "c", [3], choice=2, finish_reason="cancelled"),
        token_entry(4, 3, "d", [4], choice=0),
    ]
    choices = choices_of("j", 3, log, "ignored for n > 1")
    assert [c.engine_id for c in choices] == ["j/0", "j/1", "j/2"]
    assert [(c.resume_token_ids, c.resume_text) for c in choices] == [([1, 4], "ad"), ([2], "b"), ([3], "c")]
    assert [c.finished for c in choices] == [False, True, False]  # a cancelled choice runs again


def test_choice_seeds_follow_the_request_seed_and_wrap_within_64_bits() -> None:
    assert choice_seed(None, 3) is None
    assert choice_seed(7, 0) == 7 and choice_seed(7, 2) == 9
    assert choice_seed(2**64 - 1, 1) == 0


def test_sampling_params_carry_the_request_and_the_tier() -> None:
    r = JobRequest(prompt="hi", max_tokens=5, stop=["x", "y"], logit_bias={"3": 1.5}, seed=4)
    p = sampling_params(r, priority=11, tenant="t", tenant_weight=2.0)
    assert (p.priority, p.tenant, p.tenant_weight, p.max_tokens, p.seed) == (11, "t", 2.0, 5, 4)
    assert p.stop == ("x", "y") and p.logit_bias == ((3, 1.5),)


def test_a_job_runs_unless_it_was_cancelled_timed_out_taken_too_often_or_its_guide_failed() -> None:
    now = time.time()
    job = make_job(JobRequest(prompt="hi", max_tokens=5))
    assert refused(job, now, None) is None

    job.abort_requested = True
    (cancelled,) = refused(job, now, None) or []
    assert cancelled.finish_reason is FinishReason.CANCELLED and job.cursor.error is None

    late = make_job(JobRequest(prompt="hi", max_tokens=5, timeout_s=1))
    late.deadline = now - 1
    (ended,) = refused(late, now, None) or []
    assert ended.finish_reason is FinishReason.ERROR
    assert late.cursor.error is not None and late.cursor.error.type == "timeout"

    too_many = JobError(message="taken too often", type="too_many_attempts")
    retried = make_job(JobRequest(prompt="hi", max_tokens=5))
    assert refused(retried, now, too_many) is not None and retried.cursor.error == too_many

    guided = make_job(JobRequest(prompt="hi", max_tokens=5))
    guided.grammar_error = "bad schema"
    assert refused(guided, now, None) is not None
    assert guided.cursor.error == JobError(message="response_format: bad schema", type="invalid_request")
    assert guide_name(guided.request) == "response_format"


def test_choices_an_earlier_attempt_generated_in_full_end_with_length_and_the_rest_run() -> None:
    job = make_job(JobRequest(prompt="hi", max_tokens=2, n=3), {0: [1, 2], 1: [3]})
    ends, todo = choices_to_run(job)
    assert [(d.request_id, d.finish_reason, d.num_generated_tokens) for d in ends] == [
        ("j/0", FinishReason.LENGTH, 2)
    ]
    assert [c.index for c in todo] == [1, 2] and todo[0].resume_token_ids == [3]


def test_a_job_whose_choices_all_ended_gets_one_delta_that_only_ends_it() -> None:
    job = make_job(
        JobRequest(prompt="hi", max_tokens=2, n=2), {0: [1, 2], 1: [3, 4]}, finished=frozenset({0, 1})
    )
    ends, todo = choices_to_run(job)
    assert todo == []
    assert [(d.request_id, d.finish_reason, d.token_ids) for d in ends] == [("j/0", FinishReason.STOP, ())]


def test_end_deltas_end_the_live_choices_or_the_one_request_of_n_1() -> None:
    one = make_job(JobRequest(prompt="hi", max_tokens=5), {0: [1, 2]})
    one.cursor.completion_tokens = 2
    (d,) = end_deltas(one, FinishReason.ERROR, "boom")
    assert (d.request_id, d.finish_reason, d.num_generated_tokens, d.error) == (
        "j",
        FinishReason.ERROR,
        2,
        "boom",
    )

    many = make_job(JobRequest(prompt="hi", max_tokens=5, n=3), {1: [7]}, finished=frozenset({1}))
    assert [d.request_id for d in end_deltas(many, FinishReason.CANCELLED)] == ["j/0", "j/2"]
