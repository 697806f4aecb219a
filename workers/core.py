"""What the engine thread does to jobs, as vLLM's EngineCore: add a job's choices to the engine
(or end the job at once), abort a job, drop one another worker took over, and collect the ends
made outside ``engine.step()``.

No threads of its own and no Redis: workers/runtime.py calls it from its engine thread only, and
its writer thread writes the deltas.

Choices (n > 1): docs/internals.md#choices-n--1-workersjobpy-workerscorepy-workersappendspy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from common.schemas.checks import MAX_PRIORITY
from common.schemas.views import JobError
from common.settings import Settings
from common.tenants import tenant_of
from workers.appends import JobCursor
from workers.embedding import EmbeddingJobs
from workers.engine import Delta, Engine, FinishReason, RequestTooLongError
from workers.job import (
    Choice,
    Job,
    choice_seed,
    choices_to_run,
    end_deltas,
    prompts_of,
    refused,
    sampling_params,
)
from workers.liveness import too_many_attempts
from workers.metrics import WorkerMetrics

# SamplingParams.priority of the batch tier; an interactive job's is its request's priority (0 by
# default, within +-MAX_PRIORITY).
BATCH_LINE_PRIORITY = MAX_PRIORITY + 1


class JobCore:
    def __init__(self, engine: Engine, settings: Settings, metrics: WorkerMetrics, model: str) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self._tenant_weights = settings.tenant_weight_map  # SPOOL_TENANT_WEIGHTS
        self._pending: list[Delta] = []  # ends made outside engine.step(), written with the next step
        self.embeddings = EmbeddingJobs(engine, model)  # embedding jobs, embedded together (run)

    def has_pending(self) -> bool:
        return bool(self._pending) or self.embeddings.has_waiting()

    def take_pending(self) -> list[Delta]:
        pending, self._pending = self._pending, []
        return pending

    def add(self, job: Job) -> None:
        """Add the job's choices left to run, or end it at once (a last delta in the next step)."""
        ends = refused(job, time.time(), too_many_attempts(job.cursor.attempt, self.settings))
        if ends is None and job.request.embed is not None:
            self.embeddings.add(job)  # embedded with the others collected, after the inbox
            return
        if ends is None:
            ends, todo = choices_to_run(job)
        else:
            todo = []
        self._pending += ends
        if not todo:
            return
        tenant = tenant_of(job.owner)
        weight = self._tenant_weights.get(tenant, 1.0)
        priority = BATCH_LINE_PRIORITY if job.batch_line else job.request.priority
        params = sampling_params(job.request, priority, tenant, weight)
        added: list[Choice] = []
        n = job.request.n
        try:
            prompts = prompts_of(job.request, self.engine.tokenizer)
            lengths: dict[int, int] = {}  # prompt -> its tokens
            for c in todo:
                # A prompt's choices share it and the owner's salt: with prefix caching the first
                # computes the prompt's blocks and the others copy them (one prefill). Choice
                # i * n + j is prompt i's j-th, seeded as the j-th of a request of prompt i alone.
                # A choice resumed with tokens had its prompt scored by the attempt that logged them.
                lengths[c.index // n] = self.engine.add_request(
                    c.engine_id,
                    prompts[c.index // n],
                    replace(
                        params,
                        seed=choice_seed(params.seed, c.index % n),
                        prompt_logprobs=None if c.resume_token_ids else params.prompt_logprobs,
                    ),
                    resume_token_ids=c.resume_token_ids,
                    resume_text=c.resume_text,
                    cache_salt=job.owner,
                    json_grammar=job.json_grammar,
                )
                added.append(c)
            if len(lengths) == len(prompts):  # usage counts every prompt once, as OpenAI's
                job.cursor.prompt_tokens = sum(lengths.values())
        except ValueError as e:
            kind = "request_too_long" if isinstance(e, RequestTooLongError) else "invalid_request"
            job.cursor.error = JobError(message=str(e), type=kind)
            if added:  # their CANCELLED deltas end them; the job fails with the error
                job.abort_requested = True
                for c in added:
                    self.engine.abort(c.engine_id)
                job.in_engine = True
            self._pending += end_deltas(job, FinishReason.ERROR, str(e), [c for c in todo if c not in added])
            return
        job.in_engine = True
        cur = job.cursor
        self.metrics.added(
            cur.job_id,
            job.created_at,
            cur.prompt_tokens,
            cur.attempt,
            bool(job.resume_token_ids),
            tenant_of(job.owner),
        )

    def abort(self, job: Job | None, error: JobError | None) -> None:
        """End the job: cancelled (``error`` None) or failed with ``error``."""
        if job is None or job.abort_requested:
            return
        job.abort_requested = True
        job.cursor.error = error
        if job.in_engine:
            for eid in job.engine_ids:
                self.engine.abort(eid)  # its CANCELLED delta comes out of the next step

    def drop(self, job_id: str, job: Job | None) -> None:
        """Another worker took the job over (or it is handed back): stop it, write nothing more."""
        for eid in [job_id] if job is None else job.engine_ids:
            self.engine.abort(eid)  # its CANCELLED delta is dropped: the job is released
        self.metrics.dropped(job_id)

    def end_siblings(
        self, deltas: list[Delta], cursors: dict[str, JobCursor], job_of: Callable[[str], Job | None]
    ) -> None:
        """A choice that failed fails its job: abort the job's other choices still running."""
        for d in deltas:
            cursor = cursors.get(d.request_id)
            if d.finish_reason is FinishReason.ERROR and cursor is not None and cursor.choice_of:
                job = job_of(cursor.job_id)
                for ch in job.choices if job is not None else ():
                    if ch.engine_id != d.request_id and ch.index in cursor.live:
                        self.engine.abort(ch.engine_id)
