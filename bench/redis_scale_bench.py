"""What one Redis carries on the token path: simulated workers write, API processes relay to SSE.

On a private redis-server, ``--workers`` worker processes each take a batch of ``--batch`` jobs
(the API's create script, then the worker's take) and write ``--steps`` engine steps at ``--rate``
steps a second, as the worker's writer thread does (``prepare_appends`` then
``SyncJobStore.append_batch``, one token per job and step, the last with its ``done``), without a
model: each token's text is the time it was written. ``--apis`` real ``spool api`` processes
relay the jobs' events to SSE clients (one reader process per API, a stream per job, spread
over the APIs), which take each token's relay latency from its text (one machine, one clock).

Printed: tokens per second carried to the clients (and offered), the relay latency's p50 and p99
(written by the worker -> read by the client), Redis's CPU (``INFO cpu``: its share of a core,
and microseconds per token) and Redis commands per token (``INFO commandstats`` after ``CONFIG
RESETSTAT``, which comes after the takes and the clients' subscriptions: the steps' writes, their
publishes and what the APIs read meanwhile). One Redis only; a capacity figure is the offered
rate at which carried falls behind offered or p99 passes 50 ms. Speed is never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import redis

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # this tree's store, whatever is installed
    sys.path.insert(0, str(REPO_ROOT))

from common.schemas.requests import JobRequest
from common.settings import Settings
from common.store import Appended, AsyncJobStore, SyncJobStore
from spool_cli import procs as harness
from workers.appends import JobCursor, prepare_appends
from workers.engine import Delta, FinishReason

PREFIX = "scalebench"
SETUP_TIMEOUT_S = 120.0


def settings_for(url: str) -> Settings:
    return Settings.model_validate({"redis_url": url, "redis_prefix": PREFIX, "max_queued_jobs": 10**6})


async def create_jobs(settings: Settings, n: int) -> list[str]:
    store = AsyncJobStore.from_settings(settings)
    try:
        request = JobRequest(prompt="bench", max_tokens=10**4)
        return [(await store.create_job(request, "")).id for _ in range(n)]
    finally:
        await store.close()


def worker(
    url: str, name: str, ids: list[str], rate: float, steps: int, ready: Any, go: Any, out: Any
) -> None:
    """A simulated worker: its batch's steps at ``rate`` a second; reports its CPU and lag."""
    store = SyncJobStore.from_settings(settings_for(url))
    cursors = {j: JobCursor(j, store.take_job(j, name, "bench").attempt, 1, 0) for j in ids}
    ready.put(name)
    go.wait()
    start, cpu0, late = time.perf_counter(), time.process_time(), 0.0
    for step in range(1, steps + 1):
        due = start + (step - 1) / rate
        if (wait := due - time.perf_counter()) > 0:
            time.sleep(wait)  # the synthetic engine's pace, not a wait for a condition
        else:
            late = max(late, -wait)
        reason = FinishReason.LENGTH if step == steps else None
        text = f" {time.time():.6f}"
        deltas = [Delta(j, (1000 + step,), text, reason, 16, step) for j in ids]
        replies = store.append_batch(prepare_appends(deltas, cursors))
        assert replies == [Appended.WRITTEN] * len(ids), replies
    out.put({"cpu_s": time.process_time() - cpu0, "max_late_s": late})
    store.close()


async def read_streams(api_url: str, ids: list[str]) -> dict[str, Any]:
    """Every job's stream to its terminal event: token counts and relay latencies (seconds)."""
    latencies: list[float] = []
    ended = 0

    async def one(client: httpx.AsyncClient, job_id: str) -> None:
        nonlocal ended
        event = ""
        async with client.stream("GET", f"{api_url}/v1/jobs/{job_id}/events") as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event == "token":
                    latencies.append(time.time() - float(json.loads(line[6:])["text"]))
                elif line.startswith("data: ") and event in ("done", "error"):
                    ended += 1
                    return

    limits = httpx.Limits(max_connections=len(ids) + 8, max_keepalive_connections=len(ids) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30), limits=limits) as client:
        await asyncio.gather(*(one(client, j) for j in ids))
    return {"latencies": latencies, "ended": ended, "done_at": time.time()}


def reader(api_url: str, ids: list[str], out: Any) -> None:
    out.put(asyncio.run(read_streams(api_url, ids)))


def subscribed(admin: redis.Redis, settings: Settings, ids: Sequence[str]) -> bool:
    channels = [settings.keys.job_events(j) for j in ids]
    return all(n >= 1 for _, n in admin.pubsub_shardnumsub(*channels))


def redis_cpu(r: redis.Redis) -> float:
    cpu = r.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def run(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    procs: list[harness.Proc] = []
    children: list[Any] = []
    try:
        redis_proc, url = harness.start_redis(log_dir=log_dir)
        procs.append(redis_proc)
        settings = settings_for(url)
        admin = redis.Redis.from_url(url, decode_responses=True)
        env = harness.spool_env(url, PREFIX, max_queued_jobs=10**6, sse_ping_s=30)
        apis = []
        for i in range(args.apis):
            proc, api_url = harness.start_api(f"api-{i}", env, log_dir=log_dir)
            procs.append(proc)
            apis.append(api_url)
        n = args.workers * args.batch
        ids = asyncio.run(create_jobs(settings, n))
        out, ready, go = ctx.Queue(), ctx.Queue(), ctx.Event()
        for i, api_url in enumerate(apis):
            p = ctx.Process(target=reader, args=(api_url, ids[i :: len(apis)], out), daemon=True)
            p.start()
            children.append(p)
        harness.wait_until(
            lambda: subscribed(admin, settings, ids), "every stream subscribed", SETUP_TIMEOUT_S
        )
        wout = ctx.Queue()
        for w in range(args.workers):
            batch = ids[w * args.batch : (w + 1) * args.batch]
            p = ctx.Process(
                target=worker, args=(url, f"w{w}", batch, args.rate, args.steps, ready, go, wout), daemon=True
            )
            p.start()
            children.append(p)
        for _ in range(args.workers):
            ready.get(timeout=SETUP_TIMEOUT_S)
        admin.config_resetstat()
        cpu0, t0 = redis_cpu(admin), time.time()
        go.set()
        reads = [out.get(timeout=args.steps / args.rate + SETUP_TIMEOUT_S) for _ in apis]
        writers = [wout.get(timeout=SETUP_TIMEOUT_S) for _ in range(args.workers)]
        t1 = max(r["done_at"] for r in reads)
        redis_s = redis_cpu(admin) - cpu0
        stats = {k.removeprefix("cmdstat_"): v["calls"] for k, v in admin.info("commandstats").items()}
        admin.close()
    finally:
        for p in children:
            if p.is_alive():
                p.terminate()
        harness.stop_all(procs)
    latencies = sorted(x for r in reads for x in r["latencies"])
    generated = n * args.steps
    seconds = t1 - t0
    calls = {
        k: v
        for k, v in stats.items()
        if k not in ("config|resetstat", "info", "config", "pubsub|shardnumsub")
    }
    return {
        "workers": args.workers,
        "batch": args.batch,
        "apis": args.apis,
        "offered_tokens_per_s": n * args.rate,
        "carried_tokens_per_s": len(latencies) / seconds,
        "tokens_relayed": len(latencies),
        "tokens_generated": generated,
        "streams_ended": sum(r["ended"] for r in reads),
        "relay_p50_ms": 1000 * statistics.median(latencies),
        "relay_p99_ms": 1000 * latencies[int(0.99 * (len(latencies) - 1))],
        "redis_cpu_share": redis_s / seconds,
        "redis_cpu_us_per_token": redis_s * 1e6 / generated,
        "commands_per_token": sum(calls.values()) / generated,
        "worker_max_late_s": max(w["max_late_s"] for w in writers),
        "commands": dict(sorted(calls.items(), key=lambda kv: -kv[1])),
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="simulated workers, default 2")
    p.add_argument("--batch", type=int, default=32, help="jobs per worker (its batch), default 32")
    p.add_argument("--rate", type=float, default=20.0, help="steps a second per worker, default 20")
    p.add_argument("--steps", type=int, default=200, help="steps per worker (tokens per job), default 200")
    p.add_argument("--apis", type=int, default=2, help="API processes relaying to the clients, default 2")
    p.add_argument("--json", action="store_true", help="print the run as JSON")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="redis-scale-bench-") as log_dir:
        r = run(args, Path(log_dir))
    if args.json:
        json.dump(r, sys.stdout, indent=2)
        print()
        return
    print(
        f"{r['workers']} workers x batch {r['batch']}, {r['apis']} APIs: offered {r['offered_tokens_per_s']:.0f} "
        f"tokens/s, carried {r['carried_tokens_per_s']:.0f} tokens/s ({r['tokens_relayed']}/{r['tokens_generated']} "
        f"relayed, {r['streams_ended']} streams ended); relay p50 {r['relay_p50_ms']:.1f} ms, "
        f"p99 {r['relay_p99_ms']:.1f} ms; Redis CPU {100 * r['redis_cpu_share']:.0f}% of a core, "
        f"{r['redis_cpu_us_per_token']:.1f} us/token; {r['commands_per_token']:.2f} commands/token; "
        f"workers late by {r['worker_max_late_s'] * 1000:.0f} ms at most"
    )
    per_token = {k: round(v / r["tokens_generated"], 3) for k, v in r["commands"].items()}
    print("commands per token:", per_token)


if __name__ == "__main__":
    main()
