"""What Redis carries on the token path: simulated workers write, API processes relay to SSE.

On a private redis-server, or on a private Redis Cluster of 1, 2 or more masters (``--shards``:
the job data on the cluster in SPOOL_REDIS_BUCKETS=24 buckets, the broker on a standalone Redis
apart, as docs/operations.md says), ``--workers`` worker processes each take a batch of ``--batch`` jobs
(the API's create script, then the worker's take) and make ``--steps`` engine steps at ``--rate``
steps a second, which a writer thread writes as the worker's does (``prepare_appends``, then
``write_steps`` and ``Publisher.send``: one token per job and step, the last with its ``done``; a writer
behind Redis writes the steps that wait in one call, and the steps wait once ``OUTBOX_STEPS``
do), without a model: each token's text is the time it was made. ``--apis`` real ``spool api``
processes relay the jobs' events to SSE clients (one reader process per API, a stream per job, spread
over the APIs), which take each token's relay latency from its text (one machine, one clock).

Printed: tokens per second carried to the clients (and offered), the relay latency's p50 and p99
(written by the worker -> read by the client), Redis's CPU (``INFO cpu``: its share of a core,
and microseconds per token) and Redis commands per token (``INFO commandstats`` after ``CONFIG
RESETSTAT``, which comes after the takes and the clients' subscriptions: the steps' writes, their
publishes and what the APIs read meanwhile). On a cluster the CPU and commands are every
master's (``INFO`` of each), summed, and per master: how evenly the buckets split the load. Each
master's CPU is also measured for ``IDLE_S`` before the first step, every process up and no token
flowing (the sweeps, the batch feeder's leases, heartbeats: a cluster's buckets multiply them), so
the CPU per token is printed whole and over that idle share. A capacity figure is the offered rate
at which carried falls behind offered or p99 passes 50 ms; where the machine is too small to offer
that, "tokens/s at 80% of the busiest master" says at what rate a master's core would be the limit
(its idle share plus its CPU per token over idle). Or ``--redis-cpu`` holds each master (or the
standalone server) to a share of one core with a cgroup, so that a small machine can offer more
than the layout carries: carried tokens/s is then the capacity at that share, the steps per write
call show how far the writers fell behind, and each master's throttled time shows it was the
limit. ``--repeats`` runs the layouts in turn that many times (alternated, so the machine's load
falls on each alike) and prints each layout's medians. Speed is never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import redis

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # this tree's store, whatever is installed
    sys.path.insert(0, str(REPO_ROOT))

from common.buckets import CLUSTER_BUCKETS
from common.schemas.requests import JobRequest
from common.settings import Settings
from common.store import Append, AsyncJobStore, SyncJobStore
from spool_cli import procs as harness
from workers.appends import JobCursor, prepare_appends
from workers.engine import Delta, FinishReason
from workers.publisher import OUTBOX_STEPS, Outbox, Publisher, write_steps

PREFIX = "scalebench"
SETUP_TIMEOUT_S = 120.0
# The simulated workers renew no lease: one that lapsed mid-run would have the APIs' sweeps read
# the jobs every tick (HMGETs counted as the token path's) and requeue them. An hour outlasts any run.
LEASE_S = 3600.0


IDLE_S = 5.0  # the window that measures each master's CPU with no token flowing
CAPACITY_SHARE = 0.8  # of a core: a master's share at the capacity figure

STANDALONE = 0  # in --shards: a standalone redis-server (the broker too), not a cluster


def layout_name(shards: int) -> str:
    return "standalone" if shards == STANDALONE else f"{shards} shard{'s' if shards > 1 else ''}"


def data_settings(shards: int, url: str, broker_url: str) -> dict[str, Any]:
    """The settings that place the job data (and the broker) for this layout."""
    if shards == STANDALONE:
        return {"redis_url": url}
    return {"redis_url": url, "broker_url": broker_url, "redis_buckets": CLUSTER_BUCKETS}


def settings_for(placed: dict[str, Any]) -> Settings:
    return Settings.model_validate(
        {**placed, "redis_prefix": PREFIX, "max_queued_jobs": 10**6, "lease_s": LEASE_S}
    )


async def create_jobs(settings: Settings, n: int) -> list[str]:
    store = AsyncJobStore.from_settings(settings)
    try:
        request = JobRequest(prompt="bench", max_tokens=10**4)
        return [(await store.create_job(request, "")).id for _ in range(n)]
    finally:
        await store.close()


def worker(
    placed: dict[str, Any], name: str, ids: list[str], rate: float, steps: int, ready: Any, go: Any, out: Any
) -> None:
    """A simulated worker, its two threads as a worker's (workers/runtime.py): the engine's makes
    its batch's steps at ``rate`` a second into an outbox of ``OUTBOX_STEPS`` and waits once that
    many wait; the writer's writes what waits in one call (``write_steps``, ``Publisher``), so behind a
    busy Redis it sends fewer, larger calls. Reports its CPU, its lag and its calls."""
    store = SyncJobStore.from_settings(settings_for(placed))
    cursors = {j: JobCursor(j, store.take_job(j, name, "bench").attempt, 1, 0) for j in ids}
    outbox: Outbox = queue.Queue(maxsize=OUTBOX_STEPS)
    publisher = Publisher(store, threading.Event())
    calls = 0

    def send(appends: list[Append]) -> None:
        nonlocal calls
        sent = publisher.send(appends)
        calls += 1
        assert not sent.lost and not sent.gaps, sent

    ready.put(name)
    go.wait()
    writer = threading.Thread(target=write_steps, args=(outbox, send))
    writer.start()
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
        outbox.put(prepare_appends(deltas, cursors))  # waits while the writer is OUTBOX_STEPS behind
    outbox.put(None)
    writer.join()
    out.put({"cpu_s": time.process_time() - cpu0, "max_late_s": late, "calls": calls})
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


def subscribed(masters: Sequence[redis.Redis], settings: Settings, ids: Sequence[str]) -> bool:
    """Every job's channel has a subscriber (on the master of its slot: the others answer 0)."""
    channels = [settings.keys.job_events(j) for j in ids]
    counts = [0] * len(channels)
    for m in masters:
        for i, (_, n) in enumerate(m.pubsub_shardnumsub(*channels)):
            counts[i] += n
    return all(n >= 1 for n in counts)


def redis_cpu(r: redis.Redis) -> float:
    cpu = r.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def start_redis_layout(shards: int, log_dir: Path) -> tuple[list[harness.Proc], list[str], str]:
    """The layout's Redis processes: (procs, the masters' URLs, the broker's URL)."""
    if shards == STANDALONE:
        proc, url = harness.start_redis(log_dir=log_dir)
        return [proc], [url], url
    procs, urls = harness.start_redis_cluster(shards, log_dir / "cluster")
    try:
        broker, broker_url = harness.start_redis(data_dir=log_dir, log_dir=log_dir)
    except BaseException:
        harness.stop_all(procs)
        raise
    return [*procs, broker], urls, broker_url


class CpuCap:
    """A cgroup that holds its processes to ``share`` of one core (a CPU quota per period): cgroup
    v1's cpu controller where it is mounted, else v2's ``cpu.max``. Needs write access to the
    cgroup tree (root)."""

    PERIOD_US = 10_000  # short, so a Redis out of quota waits at most about this long
    LEAST_QUOTA_US = 1_000  # the kernel's

    def __init__(self, name: str, share: float) -> None:
        period = max(self.PERIOD_US, round(self.LEAST_QUOTA_US / share))
        quota = round(share * period)
        v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
        self.v1 = (v1 / "cpu.cfs_quota_us").exists()
        self.dir = (v1 if self.v1 else v2) / name
        try:
            self.dir.mkdir()
            if self.v1:
                (self.dir / "cpu.cfs_period_us").write_text(str(period))
                (self.dir / "cpu.cfs_quota_us").write_text(str(quota))
            else:
                (self.dir / "cpu.max").write_text(f"{quota} {period}")
        except OSError as e:
            raise SystemExit(
                f"--redis-cpu needs a writable cgroup tree with the cpu controller: {e}"
            ) from None

    def add(self, pid: int) -> None:
        (self.dir / "cgroup.procs").write_text(str(pid))

    def throttled_s(self) -> float:
        """Seconds its processes waited for quota, so far."""
        stat = dict(line.split() for line in (self.dir / "cpu.stat").read_text().splitlines())
        return int(stat["throttled_time"]) / 1e9 if self.v1 else int(stat["throttled_usec"]) / 1e6

    def remove(self) -> None:
        with contextlib.suppress(OSError):  # its processes must have ended
            self.dir.rmdir()


def redis_cpus(masters: Sequence[redis.Redis]) -> list[float]:
    return [redis_cpu(m) for m in masters]


def run(args: argparse.Namespace, shards: int, log_dir: Path) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    procs: list[harness.Proc] = []
    children: list[Any] = []
    masters: list[redis.Redis] = []
    caps: list[CpuCap] = []
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        procs, urls, broker_url = start_redis_layout(shards, log_dir)
        if args.redis_cpu:  # the masters come first, one per URL (the broker is not held)
            for i, proc in enumerate(procs[: len(urls)]):
                caps.append(CpuCap(f"spool-redis-scale-{os.getpid()}-{i}", args.redis_cpu))
                caps[-1].add(proc.pid)
        placed = data_settings(shards, urls[0], broker_url)
        settings = settings_for(placed)
        masters = [redis.Redis.from_url(u, decode_responses=True) for u in urls]
        env = harness.spool_env(
            urls[0], PREFIX, max_queued_jobs=10**6, sse_ping_s=30, lease_s=LEASE_S, **placed
        )
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
            lambda: subscribed(masters, settings, ids), "every stream subscribed", SETUP_TIMEOUT_S
        )
        wout = ctx.Queue()
        for w in range(args.workers):
            batch = ids[w * args.batch : (w + 1) * args.batch]
            p = ctx.Process(
                target=worker,
                args=(placed, f"w{w}", batch, args.rate, args.steps, ready, go, wout),
                daemon=True,
            )
            p.start()
            children.append(p)
        for _ in range(args.workers):
            ready.get(timeout=SETUP_TIMEOUT_S)
        # The CPU the layout spends with no token flowing: the APIs' and workers' sweeps, the
        # batch feeder's leases, heartbeats (a cluster's buckets multiply them), per second.
        idle0 = redis_cpus(masters)
        time.sleep(IDLE_S)  # a measuring window, not a wait for a condition
        idle = [(c1 - c0) / IDLE_S for c0, c1 in zip(idle0, redis_cpus(masters), strict=True)]
        for m in masters:
            m.config_resetstat()
        cpu0, t0 = redis_cpus(masters), time.time()
        throttled0 = [c.throttled_s() for c in caps]
        go.set()
        reads = [out.get(timeout=args.steps / args.rate + SETUP_TIMEOUT_S) for _ in apis]
        writers = [wout.get(timeout=SETUP_TIMEOUT_S) for _ in range(args.workers)]
        t1 = max(r["done_at"] for r in reads)
        used = [c1 - c0 for c0, c1 in zip(cpu0, redis_cpus(masters), strict=True)]
        throttled = [c.throttled_s() - t for c, t in zip(caps, throttled0, strict=True)]
        per_master = [
            {k.removeprefix("cmdstat_"): (v["calls"], v["usec"]) for k, v in m.info("commandstats").items()}
            for m in masters
        ]
    finally:
        for m in masters:
            m.close()
        for p in children:
            if p.is_alive():
                p.terminate()
        harness.stop_all(procs)
        for c in caps:
            c.remove()
    latencies = sorted(x for r in reads for x in r["latencies"])
    generated = n * args.steps
    seconds = t1 - t0
    ours = ("config|resetstat", "info", "config", "pubsub|shardnumsub")
    calls: dict[str, int] = {}
    usec: dict[str, int] = {}  # a script's time includes the commands it calls
    for stats in per_master:
        for k, (v, u) in stats.items():
            if k not in ours:
                calls[k] = calls.get(k, 0) + v
                usec[k] = usec.get(k, 0) + u
    master_calls = [sum(v for k, (v, _) in stats.items() if k not in ours) for stats in per_master]
    # Each master's CPU per token over what it spends idle: what grows with the tokens.
    marginal = [max(0.0, u - i * seconds) * 1e6 / generated for u, i in zip(used, idle, strict=True)]
    return {
        "layout": layout_name(shards),
        "shards": shards,
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
        "redis_cpu_share": sum(used) / seconds,
        "redis_cpu_us_per_token": sum(used) * 1e6 / generated,
        # each master's: its share of a core, its CPU per token carried by the whole layout
        "master_cpu_share": [u / seconds for u in used],
        "master_cpu_us_per_token": [u * 1e6 / generated for u in used],
        "master_commands_per_token": [c / generated for c in master_calls],
        "redis_idle_share": sum(idle),
        "master_idle_share": idle,
        "redis_marginal_us_per_token": sum(marginal),
        "master_marginal_us_per_token": marginal,
        # The token rate at which the busiest master's core would be 80% busy: its idle share,
        # plus its marginal CPU per token of the layout's.
        "tokens_per_s_at_80pct": min(
            (CAPACITY_SHARE - i) * 1e6 / m if m else float("inf") for i, m in zip(idle, marginal, strict=True)
        ),
        "commands_per_token": sum(calls.values()) / generated,
        "worker_max_late_s": max(w["max_late_s"] for w in writers),
        # how many steps a writer's call carried: above 1 where it fell behind (coalescing)
        "steps_per_write": args.workers * args.steps / sum(w["calls"] for w in writers),
        "redis_cpu_cap": args.redis_cpu,
        # each held master's time waiting for its quota, a share of the run: the masters were the limit
        "master_throttled_share": [t / seconds for t in throttled],
        "commands": dict(sorted(calls.items(), key=lambda kv: -kv[1])),
        "command_us_per_call": {k: usec[k] / calls[k] for k in calls},
    }


def parse_shards(text: str) -> list[int]:
    """The layouts of --shards: "standalone,1,2,3" -> [STANDALONE, 1, 2, 3]."""
    layouts = []
    for part in text.split(","):
        part = part.strip()
        layouts.append(STANDALONE if part in ("s", "standalone", "0") else int(part))
        if layouts[-1] < 0:
            raise argparse.ArgumentTypeError(f"not a number of shards: {part}")
    return layouts


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in runs))


def spread(runs: list[dict[str, Any]], key: str, scale: float = 1.0, fmt: str = ".0f") -> str:
    """The median, and the range when there are several runs: "1,221 (1,180-1,240)"."""
    values = sorted(scale * r[key] for r in runs)
    mid = format(statistics.median(values), "," + fmt)
    if len(values) == 1:
        return mid
    return f"{mid} ({format(values[0], ',' + fmt)}-{format(values[-1], ',' + fmt)})"


def print_table(by_layout: dict[int, list[dict[str, Any]]]) -> None:
    """One column per layout; each cell the median over the repeats and their range."""
    base = by_layout.get(1) or next(iter(by_layout.values()))
    base_carried = median_of(base, "carried_tokens_per_s")
    rows: list[tuple[str, list[str]]] = [
        ("offered tokens/s", [spread(rs, "offered_tokens_per_s") for rs in by_layout.values()]),
        ("carried tokens/s", [spread(rs, "carried_tokens_per_s") for rs in by_layout.values()]),
        (
            f"carried / carried({base[0]['layout']})",
            [f"{median_of(rs, 'carried_tokens_per_s') / base_carried:.2f}" for rs in by_layout.values()],
        ),
        ("relay p50 ms", [spread(rs, "relay_p50_ms", fmt=".1f") for rs in by_layout.values()]),
        ("relay p99 ms", [spread(rs, "relay_p99_ms", fmt=".1f") for rs in by_layout.values()]),
        (
            "Redis CPU, % of a core (all)",
            [spread(rs, "redis_cpu_share", 100, ".1f") for rs in by_layout.values()],
        ),
        (
            "Redis CPU us/token (all)",
            [spread(rs, "redis_cpu_us_per_token", fmt=".1f") for rs in by_layout.values()],
        ),
        ("commands/token", [spread(rs, "commands_per_token", fmt=".2f") for rs in by_layout.values()]),
        (
            "Redis CPU idle, % of a core (all)",
            [spread(rs, "redis_idle_share", 100, ".1f") for rs in by_layout.values()],
        ),
        (
            "Redis CPU us/token over idle (all)",
            [spread(rs, "redis_marginal_us_per_token", fmt=".1f") for rs in by_layout.values()],
        ),
        (
            "tokens/s at 80% of the busiest master",
            [spread(rs, "tokens_per_s_at_80pct") for rs in by_layout.values()],
        ),
        (
            f"capacity / capacity({base[0]['layout']})",
            [
                f"{median_of(rs, 'tokens_per_s_at_80pct') / median_of(base, 'tokens_per_s_at_80pct'):.2f}"
                for rs in by_layout.values()
            ],
        ),
        (
            "per master: us/token over idle",
            [per_master(rs, "master_marginal_us_per_token", 1, ".1f") for rs in by_layout.values()],
        ),
        (
            "per master: us/token",
            [per_master(rs, "master_cpu_us_per_token", 1, ".1f") for rs in by_layout.values()],
        ),
        (
            "per master: % of a core",
            [per_master(rs, "master_cpu_share", 100, ".1f") for rs in by_layout.values()],
        ),
        (
            "per master: commands/token",
            [per_master(rs, "master_commands_per_token", 1, ".2f") for rs in by_layout.values()],
        ),
        (
            "workers late, ms at most",
            [spread(rs, "worker_max_late_s", 1000) for rs in by_layout.values()],
        ),
        ("steps per write call", [spread(rs, "steps_per_write", fmt=".2f") for rs in by_layout.values()]),
    ]
    if base[0]["redis_cpu_cap"]:
        rows.append(
            (
                "per master: % of the run throttled",
                [per_master(rs, "master_throttled_share", 100, ".0f") for rs in by_layout.values()],
            )
        )
    heads = [f"{rs[0]['layout']} (x{len(rs)})" for rs in by_layout.values()]
    first = max(len(r[0]) for r in rows)
    widths = [max(len(h), *(len(r[1][i]) for r in rows)) for i, h in enumerate(heads)]
    print(" | ".join([" " * first, *(h.rjust(w) for h, w in zip(heads, widths, strict=True))]))
    for name, cells in rows:
        print(" | ".join([name.ljust(first), *(c.rjust(w) for c, w in zip(cells, widths, strict=True))]))


def per_master(runs: list[dict[str, Any]], key: str, scale: float, fmt: str) -> str:
    """Each master's median, "/"-separated."""
    return " / ".join(
        format(statistics.median(scale * r[key][i] for r in runs), fmt) for i in range(len(runs[0][key]))
    )


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="simulated workers, default 2")
    p.add_argument("--batch", type=int, default=32, help="jobs per worker (its batch), default 32")
    p.add_argument("--rate", type=float, default=20.0, help="steps a second per worker, default 20")
    p.add_argument("--steps", type=int, default=200, help="steps per worker (tokens per job), default 200")
    p.add_argument("--apis", type=int, default=2, help="API processes relaying to the clients, default 2")
    p.add_argument(
        "--shards",
        type=parse_shards,
        default=[STANDALONE],
        help="layouts to compare, comma-separated: 'standalone' (one redis-server, the default) "
        "or a number of cluster masters, e.g. standalone,1,2,3",
    )
    p.add_argument(
        "--redis-cpu",
        type=float,
        default=None,
        metavar="SHARE",
        help="hold each Redis of the job data (the standalone server, each master) to this share of "
        "one core (a cgroup's CPU quota; root), so that a layout's capacity can be reached on a small "
        "machine: offer more than it carries (--rate) and read carried tokens/s; default: no limit",
    )
    p.add_argument("--repeats", type=int, default=1, help="runs of each layout, alternated; default 1")
    p.add_argument("--json", action="store_true", help="print every run as JSON")
    args = p.parse_args(argv)
    by_layout: dict[int, list[dict[str, Any]]] = {s: [] for s in args.shards}
    with tempfile.TemporaryDirectory(prefix="redis-scale-bench-") as log_dir:
        for repeat in range(args.repeats):
            for shards in args.shards:
                r = run(args, shards, Path(log_dir) / f"{repeat}-{shards}")
                by_layout[shards].append(r)
                if not args.json:
                    print_run(r)
    if args.json:
        json.dump([r for rs in by_layout.values() for r in rs], sys.stdout, indent=2)
        print()
        return
    if len(by_layout) > 1 or args.repeats > 1:
        print()
        print_table(by_layout)


def print_run(r: dict[str, Any]) -> None:
    masters = ""
    if r["shards"] != STANDALONE:
        split = ", ".join(f"{u:.1f}" for u in r["master_cpu_us_per_token"])
        masters = f" (per master: {split} us/token)"
    print(
        f"{r['layout']}: {r['workers']} workers x batch {r['batch']}, {r['apis']} APIs: offered "
        f"{r['offered_tokens_per_s']:.0f} tokens/s, carried {r['carried_tokens_per_s']:.0f} tokens/s "
        f"({r['tokens_relayed']}/{r['tokens_generated']} relayed, {r['streams_ended']} streams ended); relay "
        f"p50 {r['relay_p50_ms']:.1f} ms, p99 {r['relay_p99_ms']:.1f} ms; Redis CPU "
        f"{100 * r['redis_cpu_share']:.0f}% of a core, {r['redis_cpu_us_per_token']:.1f} us/token{masters} "
        f"({100 * r['redis_idle_share']:.1f}% idle, {r['redis_marginal_us_per_token']:.1f} us/token over it); "
        f"{r['commands_per_token']:.2f} commands/token; workers late by {r['worker_max_late_s'] * 1000:.0f} ms "
        f"at most; {r['steps_per_write']:.2f} steps per write call"
    )
    if r["redis_cpu_cap"]:
        held = ", ".join(f"{100 * t:.0f}%" for t in r["master_throttled_share"])
        print(f"  each master held to {r['redis_cpu_cap']:.2f} of a core: throttled {held} of the run")
    per_token = {k: round(v / r["tokens_generated"], 3) for k, v in r["commands"].items()}
    print("  commands per token:", per_token, flush=True)
    if not r["redis_cpu_cap"]:  # Redis times a command by the clock, which a quota stops mid-command
        cost = {k: round(r["command_us_per_call"][k], 2) for k in r["commands"]}
        print("  us per call (Redis's commandstats; a script's includes its commands):", cost, flush=True)


if __name__ == "__main__":
    main()
