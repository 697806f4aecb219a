#!/usr/bin/env python
"""A trickling tenant beside another tenant's flood on the whole stack (issue 32 (b), through the
queue): where bench/fair_bench.py's flood part gives the engine every request at once, here a
worker holds only as many jobs as its task threads (its slots + SPARE_TASK_THREADS), and the rest
wait in its model's queue (each key's interactive jobs in its tenant's queue of the model, which
the worker takes in turn: common/keys.py TENANT_QUEUES).

A private redis-server, one `spool worker` (the tiny Llama, 8 slots, fair shares on, the
default) and one API (uvicorn) with two API keys. The "trickle" key sends --trickle jobs one
after the other (each a waiting POST /v1/jobs) on the idle stack; the "flood" key queues --flood
background jobs of --flood-tokens tokens; then "trickle" sends --trickle more. Printed: the
trickle jobs' queue time (created to taken by the worker) and end to end, idle and beside the
flood (docs/benchmarks.md, "Fair shares").

    nice -n 5 .venv/bin/python bench/fair_queue_bench.py     # 1,000 x 64 tokens, 5 trickle jobs
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from spool_cli import procs as harness
from workers.engine.tiny import build_tiny_model

REPO_ROOT = Path(__file__).resolve().parent.parent
KEYS = {"flood": "bench-key-flood", "trickle": "bench-key-trickle"}


def post(client: httpx.Client, who: str, tokens: int, background: bool) -> dict[str, Any]:
    body = {"prompt": "the quick brown fox", "max_tokens": tokens, "min_tokens": tokens, "temperature": 0}
    r = client.post(
        "/v1/jobs", headers={"Authorization": f"Bearer {KEYS[who]}"}, json={**body, "background": background}
    )
    r.raise_for_status()
    return r.json()  # type: ignore[no-any-return]


def trickle(client: httpx.Client, n: int) -> list[tuple[float, float]]:
    """(queue s, end to end s) of n jobs sent one after the other, each when the last ended."""
    jobs = [post(client, "trickle", 16, background=False) for _ in range(n)]
    return [(j["started_at"] - j["created_at"], j["finished_at"] - j["created_at"]) for j in jobs]


def report(name: str, xs: list[tuple[float, float]]) -> None:
    queue, e2e = [x[0] for x in xs], [x[1] for x in xs]
    print(
        f"  {name}: trickle queue time p50 {statistics.median(queue):.3f} s, max {max(queue):.3f} s "
        f"(its first {queue[0]:.3f} s); end to end p50 {statistics.median(e2e):.3f} s, max {max(e2e):.3f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flood", type=int, default=1000, help="the flooding key's background jobs")
    ap.add_argument("--flood-tokens", type=int, default=64, help="tokens of each flood job")
    ap.add_argument("--trickle", type=int, default=5, help="the trickling key's jobs, idle and beside")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="spool-fair-queue-bench-") as tmp:
        logs, procs = Path(tmp), list[harness.Proc]()
        try:
            server, url = harness.start_redis(data_dir=logs, log_dir=logs)
            procs.append(server)
            settings: dict[str, object] = {
                "api_keys": ",".join(KEYS.values()),
                "max_queued_jobs": 2 * args.flood,
                "max_queued_jobs_per_key": 2 * args.flood,  # one key floods on purpose
            }
            model = build_tiny_model(logs / "tiny", "llama")
            env = harness.spool_env(
                url, "fairqueue", model=model, max_batch_size=8, compile=False, **settings
            )
            argv = [*harness.spool_argv(), "worker"]
            procs.append(harness.start("worker", argv, env=env, log_dir=logs, cwd=REPO_ROOT))
            api, api_url = harness.start_api(
                "api", harness.spool_env(url, "fairqueue", **settings), log_dir=logs, tree=REPO_ROOT
            )
            procs.append(api)
            ready = lambda: harness.http_status(f"{api_url}/readyz") == 200  # noqa: E731
            harness.wait_until(ready, "a ready worker", 300, procs)
            with httpx.Client(base_url=api_url, timeout=600) as client:
                idle = trickle(client, args.trickle)
                t0 = time.perf_counter()
                with ThreadPoolExecutor(8) as pool:
                    list(
                        pool.map(lambda _: post(client, "flood", args.flood_tokens, True), range(args.flood))
                    )
                queued_s = time.perf_counter() - t0
                beside = trickle(client, args.trickle)
        finally:
            harness.stop_all(procs)
    print(f"flood: {args.flood} jobs of {args.flood_tokens} tokens, queued in {queued_s:.1f} s")
    report("idle", idle)
    report("beside the flood", beside)


if __name__ == "__main__":
    main()
