"""Redis commands and CPU per generated token on the worker's write path (the step writes).

On a private redis-server, the script takes ``--jobs`` jobs (the API's create script, then the
worker's take) and writes ``--tokens`` steps for all of them as the worker's writer thread does
(``prepare_appends`` then ``SyncJobStore.append_batch``, one call per step: one token event
per job, the last step with its ``done``), while one pub/sub connection subscribes to every job's channel, as an API's hub
streaming them would, and reads what is published. ``CONFIG RESETSTAT`` comes after the takes,
so the figures are the writes' alone: ``INFO commandstats`` (every command, those a script runs
included) per generated token, script calls per step, Redis's CPU per token (``INFO cpu``) and
the writing thread's own CPU per token. Only the write path: a whole service adds the job's
creation, take, Celery's messages and the heartbeats (``bench/stack_bench.py``).

To compare with an earlier commit: ``git worktree add /tmp/before REV``, copy this file into
``/tmp/before/bench/`` and run it there with that tree's ``.venv``-less imports
(``cd /tmp/before && /path/to/.venv/bin/python bench/redis_bench.py``). Speed is never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # this tree's store, whatever is installed
    sys.path.insert(0, str(REPO_ROOT))

from common.schemas.requests import JobRequest
from common.settings import Settings
from common.store import Append, Appended, AsyncJobStore, SyncJobStore
from spool_cli import procs as harness
from workers.appends import JobCursor, prepare_appends
from workers.engine import Delta, FinishReason

PREFIX = "redisbench"


def settings_for(url: str) -> Settings:
    return Settings.model_validate({"redis_url": url, "redis_prefix": PREFIX, "max_queued_jobs": 10**6})


async def create_jobs(settings: Settings, n: int) -> list[str]:
    store = AsyncJobStore.from_settings(settings)
    try:
        return [
            (await store.create_job(JobRequest(prompt="bench", max_tokens=10**4), "")).id for _ in range(n)
        ]
    finally:
        await store.close()


def drain(pubsub: redis.client.PubSub, stop: threading.Event, seen: list[int]) -> None:
    while not stop.is_set():
        if pubsub.get_message(timeout=0.1):
            seen[0] += 1


def step_appends(cursors: dict[str, JobCursor], step: int, last: bool) -> list[Append]:
    """One step's appends as the writer builds them (``build_append``: the text key and counts
    at a checkpoint only, every ``TEXT_CHECKPOINT_EVENTS`` events and at a job's first and last)."""
    reason = FinishReason.LENGTH if last else None
    deltas = [Delta(j, (1000 + step,), " word", reason, 16, step) for j in cursors]
    return prepare_appends(deltas, cursors)


def run(jobs_n: int, tokens: int, log_dir: Path) -> dict[str, Any]:
    proc, url = harness.start_redis(log_dir=log_dir)
    try:
        settings = settings_for(url)
        store = SyncJobStore.from_settings(settings)
        ids = asyncio.run(create_jobs(settings, jobs_n))
        cursors = {j: JobCursor(j, store.take_job(j, "bench", "bench").attempt, 1, 0) for j in ids}
        admin = redis.Redis.from_url(url, decode_responses=True)
        pubsub = admin.pubsub()
        pubsub.ssubscribe(*(settings.keys.job_events(j) for j in ids))
        while pubsub.get_message(timeout=1.0):  # the subscriptions' confirmations
            pass
        stop, seen = threading.Event(), [0]
        reader = threading.Thread(target=drain, args=(pubsub, stop, seen), daemon=True)
        reader.start()
        admin.config_resetstat()
        cpu0 = _redis_cpu(admin)
        thread0 = time.thread_time()
        for step in range(1, tokens + 1):
            replies = store.append_batch(step_appends(cursors, step, step == tokens))
            assert replies == [Appended.WRITTEN] * jobs_n, replies
        thread_s = time.thread_time() - thread0
        redis_s = _redis_cpu(admin) - cpu0
        stats = {k.removeprefix("cmdstat_"): v["calls"] for k, v in admin.info("commandstats").items()}
        deadline = time.monotonic() + 10
        while seen[0] < jobs_n * (tokens + 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        stop.set()
        reader.join()
        generated = jobs_n * tokens
        # CONFIG RESETSTAT itself and the INFO calls are the script's, not the writes'.
        writes = {k: v for k, v in stats.items() if k not in ("config|resetstat", "info", "config")}
        scripts = sum(v for k, v in writes.items() if k in ("evalsha", "eval", "fcall"))
        return {
            "jobs": jobs_n,
            "steps": tokens,
            "generated_tokens": generated,
            "published_seen": seen[0],
            "commands_per_token": sum(writes.values()) / generated,
            "script_calls_per_step": scripts / tokens,
            "redis_cpu_us_per_token": redis_s * 1e6 / generated,
            "writer_cpu_us_per_token": thread_s * 1e6 / generated,
            "commands": dict(sorted(writes.items(), key=lambda kv: -kv[1])),
        }
    finally:
        harness.stop_all([proc])


def _redis_cpu(r: redis.Redis) -> float:
    cpu = r.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=32, help="jobs per step (the batch size), default 32")
    p.add_argument("--tokens", type=int, default=64, help="steps, one token per job each; default 64")
    p.add_argument("--rounds", type=int, default=3, help="runs, each on a fresh redis-server; default 3")
    p.add_argument("--json", action="store_true", help="print the runs as JSON")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="redis-bench-") as log_dir:
        runs = [run(args.jobs, args.tokens, Path(log_dir)) for _ in range(args.rounds)]
    if args.json:
        json.dump(runs, sys.stdout, indent=2)
        print()
        return
    for r in runs:
        print(
            f"batch {r['jobs']}, {r['steps']} steps: {r['commands_per_token']:.2f} commands/token, "
            f"{r['script_calls_per_step']:.1f} script calls/step, Redis CPU {r['redis_cpu_us_per_token']:.1f} us/token, "
            f"writer CPU {r['writer_cpu_us_per_token']:.1f} us/token"
        )
    per_token = {k: round(v / runs[-1]["generated_tokens"], 3) for k, v in runs[-1]["commands"].items()}
    print("commands per token (last run):", per_token)


if __name__ == "__main__":
    main()
