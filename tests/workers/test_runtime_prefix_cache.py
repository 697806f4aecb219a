"""The worker salts the engine's prefix cache with each job's owner: owners never share."""

from __future__ import annotations

from common.schemas.requests import JobRequest
from common.store import SyncJobStore
from workers.runtime import EngineRuntime
from workers.task_common import Outcome

# Long enough for a few whole 16-token blocks of the tiny model's tokenizer.
PROMPT = "the quick brown fox jumps over the lazy dog while rivers run to the sea " * 3


def hits(runtime: EngineRuntime) -> int:
    return int(runtime.engine.stats()["prefix_cache_hits"])


def run(runtime: EngineRuntime, store: SyncJobStore, owner: str) -> None:
    job = store.create_job(JobRequest(prompt=PROMPT, max_tokens=2, temperature=0), owner=owner)
    assert runtime.run_job(job.id) is Outcome.FINISHED


def test_jobs_of_one_owner_share_cached_prefixes_and_other_owners_do_not(
    runtime: EngineRuntime, store: SyncJobStore
) -> None:
    run(runtime, store, owner="owner-a")
    before = hits(runtime)
    run(runtime, store, owner="owner-b")
    assert hits(runtime) == before  # owner-a's cached prompt is not owner-b's
    run(runtime, store, owner="owner-a")
    assert hits(runtime) > before
