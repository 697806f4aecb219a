"""A soak run: a mixed workload through the whole service for minutes; memory, Redis and leaks.

It starts a private redis-server, one ``spool worker`` on the embedded default model (what
``spool up`` serves) and one API (``python -m uvicorn api.main:app``), all under their own key
prefix with ``SPOOL_JOB_TTL_S`` short enough that finished jobs expire during the run. Then
``--clients`` concurrent clients (default 32) send requests, round after round, for
``--minutes``, each drawn from this mix:

- ``stream``: ``POST /v1/jobs`` with ``"stream": true``, read to its terminal event; then the
  job's ``text`` must equal the concatenated token texts;
- ``poll``: submit, then ``GET /v1/jobs/{id}`` until it is final (succeeded);
- ``resume``: a streamed submit dropped after 1 to 20 events, then ``GET .../events`` with
  ``Last-Event-ID``: the ids of both must be 1..n, without gap or repeat;
- ``cancel``: submit, cancel within 0.2 s, then stream its events to the terminal one;
- ``openai``: ``POST /v1/completions`` with ``"stream": true``, read to ``data: [DONE]``;
- ``bad``: a body out of range, which must be a 422 in the error envelope.

Every ten rounds it samples the API's and the worker's resident memory (``/proc``), Redis's key
count and memory, and the API's open streams (``spool_sse_streams``). At the end it waits for the
last streams to close and checks that nothing is left behind: no open stream in the API, no
job channel still subscribed in Redis, no key of a job (all have ended) without an expiry, no field
left in ``{p}:attempts`` (a job's last append drops its own). It prints the samples, the growth of each process's
memory from the end of the first minute (the warm-up: allocator pools, caches) to the end, and
every failed check, and exits 1 if there was one. Memory figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
from measure import log, rss_kib

from common.keys import Keys
from spool_cli import procs as harness

REPO_ROOT = Path(__file__).resolve().parent.parent

PREFIX = "soak"
KINDS = {"stream": 10, "poll": 4, "resume": 3, "cancel": 2, "openai": 2, "bad": 1}  # relative weights
PROMPTS = ["ROMEO:", "JULIET:", "To be, or not to be", "Now is the winter of our discontent"]
SAMPLE_EVERY = 10  # rounds


@dataclass
class Tally:
    done: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)


async def sse_events(response: httpx.Response, stop_after: int | None = None) -> list[tuple[int, str, Any]]:
    """(id, event, data) of each event with an id, up to the terminal one (or ``stop_after``)."""
    events: list[tuple[int, str, Any]] = []
    fields: dict[str, str] = {}
    async for line in response.aiter_lines():
        if line:
            name, _, value = line.partition(":")
            fields[name] = value.removeprefix(" ")
            continue
        if "id" in fields and "event" in fields:
            events.append((int(fields["id"]), fields["event"], json.loads(fields["data"])))
            if fields["event"] in ("done", "error") or len(events) == stop_after:
                break
        fields = {}
    return events


def check_ids(ids: list[int], what: str) -> None:
    if ids != list(range(1, len(ids) + 1)):
        raise AssertionError(f"{what}: ids {ids[:5]}... not consecutive from 1")


async def one_request(client: httpx.AsyncClient, kind: str) -> None:
    body = {"prompt": random.choice(PROMPTS), "max_tokens": random.randint(8, 64), "temperature": 0.8}
    if kind == "stream":
        async with client.stream("POST", "/v1/jobs", json={**body, "stream": True}) as r:
            r.raise_for_status()
            job_url = r.headers["location"]
            events = await sse_events(r)
        check_ids([e[0] for e in events], "stream")
        assert events[-1][1] == "done", events[-1]
        text = "".join(data["text"] for _, event, data in events if event == "token")
        assert (await client.get(job_url)).json()["text"] == text, "the job's text is not its tokens'"
    elif kind == "poll":
        job = (await client.post("/v1/jobs", json=body)).raise_for_status().json()
        while job["status"] in ("queued", "running"):
            await asyncio.sleep(0.05)
            job = (await client.get(f"/v1/jobs/{job['id']}")).raise_for_status().json()
        assert job["status"] == "succeeded", job
    elif kind == "resume":
        async with client.stream("POST", "/v1/jobs", json={**body, "max_tokens": 64, "stream": True}) as r:
            r.raise_for_status()
            job_url = r.headers["location"]
            first = await sse_events(r, stop_after=random.randint(1, 20))
        headers = {"Last-Event-ID": str(first[-1][0])}
        async with client.stream("GET", f"{job_url}/events", headers=headers) as r:
            rest = await sse_events(r.raise_for_status())
        check_ids([e[0] for e in first + rest], "resumed stream")
    elif kind == "cancel":
        job = (await client.post("/v1/jobs", json={**body, "max_tokens": 256})).raise_for_status().json()
        await asyncio.sleep(random.random() * 0.2)
        r = await client.post(f"/v1/jobs/{job['id']}/cancel")
        assert r.status_code in (200, 409), r.text  # 409: it had already succeeded
        async with client.stream("GET", f"/v1/jobs/{job['id']}/events") as r:
            events = await sse_events(r.raise_for_status())
        check_ids([e[0] for e in events], "cancelled stream")
        assert events[-1][1] == "done", events[-1]
    elif kind == "openai":
        chunks = 0
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            async for line in r.raise_for_status().aiter_lines():
                chunks += line.startswith("data: {")
                if line == "data: [DONE]":
                    break
            else:
                raise AssertionError("the completion stream ended without [DONE]")
        assert chunks > 0
    else:
        r = await client.post("/v1/jobs", json={**body, "max_tokens": -1})
        assert r.status_code == 422 and "error" in r.json(), r.text


async def run_requests(client: httpx.AsyncClient, kind: str, tally: Tally) -> None:
    try:
        await one_request(client, kind)
    except Exception as e:  # noqa: BLE001 (every failure is reported, and the run goes on)
        tally.failures.append(f"{kind}: {e!r}"[:300])
    else:
        tally.done[kind] += 1


async def open_streams(client: httpx.AsyncClient) -> float:
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith("spool_sse_streams "):
            return float(line.split()[1])
    raise RuntimeError("no spool_sse_streams in /metrics")


async def soak(
    args: argparse.Namespace, api_url: str, pids: dict[str, int], r: redis.Redis
) -> dict[str, Any]:
    tally, samples = Tally(), []
    kinds, weights = list(KINDS), list(KINDS.values())
    limits = httpx.Limits(max_connections=4 * args.clients)
    async with httpx.AsyncClient(base_url=api_url, timeout=120, limits=limits) as client:
        start = time.monotonic()
        rounds = 0
        while time.monotonic() - start < 60 * args.minutes:
            picks = random.choices(kinds, weights, k=args.clients)
            await asyncio.gather(*(run_requests(client, kind, tally) for kind in picks))
            rounds += 1
            if rounds % SAMPLE_EVERY == 1:
                sample = {
                    "t_s": round(time.monotonic() - start, 1),
                    "requests": sum(tally.done.values()),
                    **{f"{name}_rss_kib": rss_kib(pid)["VmRSS"] for name, pid in pids.items()},
                    "redis_keys": r.dbsize(),
                    "redis_used_kib": r.info("memory")["used_memory"] // 1024,
                    "api_open_streams": await open_streams(client),
                }
                samples.append(sample)
                log(json.dumps(sample))
        # Every stream has ended at its client; the server's side of it ends right after.
        deadline = time.monotonic() + 10
        while await open_streams(client) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = {
            "api_open_streams": await open_streams(client),
            "job_channels_subscribed": len(r.pubsub_shardchannels(f"{PREFIX}:job:*")),
            # Every job has ended: each of its keys must expire (SPOOL_JOB_TTL_S) or be gone.
            "job_keys_without_expiry": sum(
                r.ttl(k) == -1 for k in r.scan_iter(f"{PREFIX}:job:*", count=1000)
            ),
            # ... and its last append dropped its field of the fencing hash (one HLEN).
            "attempts_fields": r.hlen(Keys(PREFIX).attempts(0)),
        }
    return {"rounds": rounds, "tally": tally, "samples": samples, "left": left}


def growth(samples: list[dict[str, Any]], key: str) -> tuple[int, int, int]:
    """(after the first minute, at the end, requests in between) for a memory figure."""
    warm = next((s for s in samples if s["t_s"] >= 60), samples[0])
    return warm[key], samples[-1][key], samples[-1]["requests"] - warm["requests"]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=32, help="concurrent requests per round")
    parser.add_argument(
        "--job-ttl-s", type=int, default=20, help="SPOOL_JOB_TTL_S: finished jobs expire after this"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args()
    random.seed(args.seed)

    with tempfile.TemporaryDirectory(prefix="spool-soak-") as tmp:
        logs = Path(tmp)
        procs: list[harness.Proc] = []
        try:
            redis_server, redis_url = harness.start_redis(data_dir=logs, log_dir=logs)
            procs.append(redis_server)
            env = harness.spool_env(redis_url, PREFIX, job_ttl_s=args.job_ttl_s)
            worker = harness.start(
                "worker", [*harness.spool_argv(), "worker"], env=env, log_dir=logs, cwd=REPO_ROOT
            )
            procs.append(worker)
            api, api_url = harness.start_api("api", env, log_dir=logs, tree=REPO_ROOT)
            procs.append(api)
            harness.wait_until(
                lambda: harness.http_status(f"{api_url}/readyz") == 200, "a ready worker", 120, [worker]
            )
            r = redis.Redis.from_url(redis_url)
            result = asyncio.run(soak(args, api_url, {"api": api.pid, "worker": worker.pid}, r))
        finally:
            harness.stop_all(procs)

    tally: Tally = result["tally"]
    samples = result["samples"]
    print(f"Spool soak: {args.minutes:g} min, {args.clients} concurrent clients, {result['rounds']} rounds")
    print(
        "requests by kind: " + ", ".join(f"{k} {tally.done[k]}" for k in KINDS),
        f"(failed: {len(tally.failures)})",
    )
    for name in ("api", "worker"):
        warm, end, requests = growth(samples, f"{name}_rss_kib")
        per_k = (end - warm) / max(requests, 1) * 1000
        print(f"{name} RSS: {warm / 1024:.1f} MiB after the first minute, {end / 1024:.1f} MiB at the end "
              f"({(end - warm) / 1024:+.2f} MiB over {requests} requests: {per_k:+.1f} KiB per 1,000)")  # fmt: skip
    keys = [s["redis_keys"] for s in samples]
    print(
        f"Redis keys: {min(keys)} to {max(keys)} over the samples (finished jobs expire after {args.job_ttl_s} s)"
    )
    left = result["left"]
    print(
        f"left at the end: {left['api_open_streams']:g} open streams in the API, "
        f"{left['job_channels_subscribed']} job channels subscribed, "
        f"{left['job_keys_without_expiry']} job keys without an expiry, "
        f"{left['attempts_fields']} fields in the attempts hash"
    )
    leaks = [f"{k}: {v}" for k, v in left.items() if v]
    for failure in tally.failures[:20] + leaks:
        print("FAILED", failure)
    if args.json:
        figures = {**result, "tally": {"done": dict(tally.done), "failures": tally.failures}}
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, **figures}, indent=1))
    return 1 if tally.failures or leaks else 0


if __name__ == "__main__":
    sys.exit(main())
