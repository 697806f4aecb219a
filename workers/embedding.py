"""The embedding jobs of a worker whose model embeds (docs/openai.md, "Embeddings").

The engine thread collects them as its inbox hands them over (``JobCore.add``) and embeds every
job collected at once in one call (``EmbeddingJobs.run``): the inputs of several jobs share the
forwards. A job's vectors are its terminal event (``DoneEvent.embeddings``), written by the
writer thread as any step's appends, fenced by the job's attempt. A job that fails (too long an
input, a model that does not embed) ends as a generation job that fails: a last delta.
"""

from __future__ import annotations

import base64
import logging

import torch

from common.schemas.events import DoneEvent, LogEntry
from common.schemas.views import JobError, JobStatus, Usage
from common.store import Append, Final
from workers.engine import Delta, Engine, FinishReason
from workers.engine.embedder import EmbeddingEngine, normalized
from workers.job import Job, end_delta

log = logging.getLogger(__name__)


class EmbeddingJobs:
    def __init__(self, engine: Engine, model: str) -> None:
        self.engine = engine
        self.model = model
        self._waiting: list[Job] = []

    def add(self, job: Job) -> None:
        self._waiting.append(job)

    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def run(self) -> tuple[list[Append], list[Delta]]:
        """Embed every job waiting: the appends of those embedded, the last deltas of the rest."""
        jobs, self._waiting = self._waiting, []
        ends: list[Delta] = []
        todo: list[tuple[Job, list[list[int]]]] = []
        for job in jobs:
            inputs, error = self._inputs(job)
            if job.abort_requested:  # cancelled (or failed by the runtime) before it ran
                ends.append(end_delta(job, FinishReason.CANCELLED))
            elif error is not None:
                job.cursor.error = error
                ends.append(end_delta(job, FinishReason.ERROR, error.message))
            else:
                todo.append((job, inputs))
        if not todo:
            return [], ends
        assert isinstance(self.engine, EmbeddingEngine)  # else _inputs refused them
        embedder = self.engine.embedder
        try:
            pooled = embedder.pooled([ids for _, inputs in todo for ids in inputs])
        except Exception as e:  # the forward failed (out of memory, ...): so do its jobs, saying why
            log.exception("embedding %d jobs failed", len(todo))
            message = f"the embedding forward failed: {type(e).__name__}: {e}"
            for job, _ in todo:
                job.cursor.error = JobError(message=message, type="engine_error")
                ends.append(end_delta(job, FinishReason.ERROR, message))
            return [], ends
        appends, row = [], 0
        for job, inputs in todo:
            assert job.request.embed is not None
            vectors = normalized(pooled[row : row + len(inputs)], job.request.embed.dimensions)
            row += len(inputs)
            appends.append(_append(job, vectors, sum(map(len, inputs))))
        return appends, ends

    def _inputs(self, job: Job) -> tuple[list[list[int]], JobError | None]:
        """The job's inputs as token ids, or why it cannot be embedded."""
        embed = job.request.embed
        assert embed is not None
        if not isinstance(self.engine, EmbeddingEngine):
            message = f"the model {self.model} does not embed; it generates text"
            return [], JobError(message=message, type="invalid_request")
        embedder = self.engine.embedder
        if embed.dimensions is not None and embed.dimensions not in embedder.dimensions:
            message = f"dimensions {embed.dimensions} is not one the model {self.model} answers with ({_sizes(embedder.dimensions)})"
            return [], JobError(message=message, type="invalid_request")
        texts = [t for t in embed.input if isinstance(t, str)]
        inputs = [list(ids) for ids in embedder.tokenizer(texts)["input_ids"]] if texts else []
        if not texts:
            inputs = [list(t) for t in embed.input if isinstance(t, list)]
        vocab = embedder.vocab_size
        try:
            embedder.check(inputs)
        except ValueError as e:
            return [], JobError(message=str(e), type="request_too_long")
        if any(not 0 <= i < vocab for ids in inputs for i in ids):
            return [], JobError(
                message=f"a token id is outside the model's vocabulary, 0..{vocab - 1}",
                type="invalid_request",
            )
        job.cursor.prompt_tokens = sum(map(len, inputs))
        return inputs, None


def _sizes(dims: tuple[int, ...]) -> str:
    return ", ".join(map(str, dims))


def _append(job: Job, vectors: torch.Tensor, tokens: int) -> Append:
    cursor = job.cursor
    encoded = [base64.b64encode(v.tobytes()).decode() for v in vectors.numpy().astype("<f4")]
    usage = Usage.of(tokens, 0)
    done = DoneEvent(status=JobStatus.SUCCEEDED, finish_reason="stop", usage=usage, embeddings=encoded)
    entry = LogEntry.done(cursor.next(), done)
    cursor.ended = True
    return Append(
        cursor.job_id, cursor.attempt, [entry], tokens, 0, Final(JobStatus.SUCCEEDED, "stop"), unsaved_text=""
    )
