"""Embedding jobs in a worker whose model embeds (workers/embedding.py), with the real Redis: the
jobs waiting at once are embedded in one forward, and each job's terminal event carries its
vectors, equal to the embedder's alone."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from procs import REDIS_URL
from store_helpers import StoreForTests

from common.schemas.requests import JobRequest
from common.schemas.views import JobStatus
from common.settings import Settings, load_settings
from common.store import SyncJobStore
from workers.embedding import EmbeddingJobs
from workers.engine.embedder import EmbeddingConfig, EmbeddingEngine
from workers.engine.tiny_embedding import build_tiny_embedding_model
from workers.job import new_job
from workers.runtime import EngineRuntime
from workers.task_common import Outcome

TEXTS = ["the quick brown fox", "once upon a time", "바람이 분다", "to be or not to be"]


@pytest.fixture(scope="module")
def embedding_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_embedding_model(tmp_path_factory.mktemp("tiny-embedding"))


@pytest.fixture(scope="module")
def settings(prefixes, embedding_model: Path) -> Settings:  # type: ignore[no-untyped-def]
    return load_settings(
        redis_url=REDIS_URL,
        redis_prefix=prefixes.new(),
        model=str(embedding_model),
        heartbeat_s=0.1,
        lease_s=5,
        job_ttl_s=120,
        embedding_dimensions="16",
    )


@pytest.fixture(scope="module")
def store(settings: Settings) -> Iterator[StoreForTests]:
    s = StoreForTests.from_settings(settings)
    yield s
    s.close()


def vectors(done_data: dict[str, object]) -> torch.Tensor:
    rows = []
    for b64 in done_data["embeddings"]:  # type: ignore[attr-defined]
        raw = base64.b64decode(b64)
        rows.append(struct.unpack(f"<{len(raw) // 4}f", raw))
    return torch.tensor(rows)


def test_jobs_waiting_together_share_one_forward(settings: Settings, store: StoreForTests) -> None:
    engine = EmbeddingEngine(EmbeddingConfig(model=str(settings.model), dimensions=(16,)), "m")
    embedder = engine.embedder
    jobs = EmbeddingJobs(engine, "m")
    worker_store = SyncJobStore.from_settings(settings)
    requests = [
        JobRequest(embed={"input": TEXTS[: i + 1], "dimensions": 16 if i % 2 else None})  # type: ignore[arg-type]
        for i in range(4)
    ]
    created = [store.create_job(r) for r in requests]
    try:
        for job in created:
            jobs.add(new_job(worker_store.take_job(job.id, "w", "m")))
        appends, ends = jobs.run()
    finally:
        worker_store.close()
    assert ends == [] and embedder.forwards == 1 and embedder.embedded == 1 + 2 + 3 + 4
    for i, append in enumerate(appends):
        [done] = append.entries
        assert done.type == "done" and append.final is not None
        alone = embedder.embed([embedder.encode(t) for t in TEXTS[: i + 1]], 16 if i % 2 else None)
        torch.testing.assert_close(vectors(done.data), alone, atol=1e-6, rtol=0)
        assert done.data["usage"]["prompt_tokens"] == sum(len(embedder.encode(t)) for t in TEXTS[: i + 1])


def test_runtime_runs_embedding_jobs(settings: Settings, store: StoreForTests) -> None:
    runtime = EngineRuntime.from_settings(settings, "test-embedder")
    try:
        assert runtime.heartbeat_fields()["embedding_dimensions"] == [64, 16]
        job = store.create_job(JobRequest(embed={"input": TEXTS}))  # type: ignore[arg-type]
        assert runtime.run_job(job.id) is Outcome.FINISHED
        got = store.get_job(job.id)
        assert got.status is JobStatus.SUCCEEDED and got.usage.prompt_tokens > 0
        done = store.read_log(job.id)[-1]
        assert done.type == "done" and vectors(done.data).shape == (len(TEXTS), 64)
        # A job whose worker died after taking it (its lease lapsed) is taken over and embedded.
        orphan = store.create_job(JobRequest(embed={"input": TEXTS[:2]}))  # type: ignore[arg-type]
        dead = SyncJobStore.from_settings(settings)
        try:
            assert dead.take_job(orphan.id, "dead-worker", "m").record is not None
            dead.lapse_leases({orphan.id: 1})
        finally:
            dead.close()
        assert runtime.run_job(orphan.id) is Outcome.FINISHED
        taken_over = store.get_job(orphan.id)
        assert taken_over.status is JobStatus.SUCCEEDED
        assert int(store.redis.hget(store.keys.job(orphan.id), "attempt")) == 2  # type: ignore[arg-type]
        assert vectors(store.read_log(orphan.id)[-1].data).shape == (2, 64)
        # A generation job on a model that embeds fails, saying so.
        text = store.create_job(JobRequest(prompt="hello", max_tokens=2))
        assert runtime.run_job(text.id) is Outcome.FINISHED
        failed = store.get_job(text.id)
        assert failed.status is JobStatus.FAILED and failed.error is not None
        assert "embeds and does not generate" in failed.error.message
        # Too long an input fails its job, naming the limit.
        long = store.create_job(JobRequest(embed={"input": ["word " * 300]}))  # type: ignore[arg-type]
        assert runtime.run_job(long.id) is Outcome.FINISHED
        too_long = store.get_job(long.id)
        assert too_long.error is not None and too_long.error.type == "request_too_long"
        assert "limit of 256 tokens" in too_long.error.message
    finally:
        runtime.close()


def test_embedding_with_no_model_named_is_the_tiny_embedding_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers.loader import load_engine

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # built into this cache, then loaded from it
    settings = load_settings(embedding=True)
    assert settings.served_model == "spool-tiny-embedding"
    for _ in range(2):
        engine = load_engine(settings)
        assert isinstance(engine, EmbeddingEngine) and engine.embedder.pooling == "mean"
    assert (tmp_path / "spool" / "spool-tiny-embedding" / "modules.json").is_file()
