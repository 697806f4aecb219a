#!/usr/bin/env python
"""Fair shares between tenants in the engine: the Virtual Token Counter against first come, first
served, one run, side by side; and two models on one Redis (docs/benchmarks.md, "Fair shares").

backlogged, flood and throughput run the engine alone (no Redis, no HTTP), on the tiny Llama
(built in a temp dir), EOS ignored:

backlogged  two tenants submit at once: "long" N requests of 32..64 prompt tokens and 32..64 new
            ones, then "short" N requests of 8..16 and 8..16. While both wait: the weighted
            service (prompt + 2 x generated tokens) each gets per window of W steps, the largest
            gap between them over those windows, and Jain's fairness index over the period
            ((a + b)^2 / (2 (a^2 + b^2)), 1 is an even split).
flood       "flood" submits F short requests at once; "trickle" sends T requests one after the
            other (each when the last ended): trickle's time to first token p50 and p99 against
            its figure on an idle engine, and the engine steps to its first token (1: the first
            step after it arrived), which the machine's load cannot bend.
throughput  generated tokens per second of the backlogged run, fairness on / off: the median of
            --repeats runs each, FCFS and fair alternating, so that a change in the machine's load
            falls on both; also per CPU second of this process and per engine step, which other
            processes on a shared machine bend less than the wall clock.
service     flood's figure through the whole stack, where a user sees it: a Redis (as for models),
            one `spool worker` with fair shares off, then on, one API with two API keys; "trickle"
            sends T streamed completions one by one, alone and then while "flood" has F short
            jobs queued (POST /v1/jobs): TTFT from each POST to its first chunk, at the client.
            The worker runs torch on the CPUs minus one, as `spool up` starts it beside the API
            and Redis (--worker-torch-threads to change it).
models      the whole stack: a Redis (a private redis-server, or --redis-url under a prefix of
            its own, deleted at the end), two `spool worker`s, "a" on the tiny Llama and "b" on a
            tiny GPT-2 with a tokenizer of its own, one API (uvicorn); J completions per model
            sent over HTTP, interleaved, queued at once (background): how many ran on their own
            model's worker (the job's `model` and the worker its record names), and the wall time
            from the first job created to the last one ended. tests/test_models.py checks each
            text against its own model's greedy output.

    .venv/bin/python bench/fair_bench.py                    # every part: N=200, F=2000, T=40, J=200
    nice -n 5 .venv/bin/python bench/fair_bench.py --requests 100 --flood 500 --trickle 20 --repeats 2
    .venv/bin/python bench/fair_bench.py --parts flood      # some parts: backlogged, flood, service, models
    .venv/bin/python bench/fair_bench.py --parts flood --compile   # the compiled forward, as the service runs
    .venv/bin/python bench/fair_bench.py --parts models --jobs 5 --redis-url redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import redis

from api.auth import owner_of as auth_owner
from common.keys import Keys
from common.schemas.views import JobStatus
from common.tenants import tenant_of
from spool_cli import procs as harness
from spool_cli.up import worker_torch_threads
from workers.engine import Engine, EngineConfig, SamplingParams, TokenWeights
from workers.engine.tiny import build_tiny_model

REPO_ROOT = Path(__file__).resolve().parent.parent
WEIGHTS = TokenWeights()  # prompt 1, output 2: the service counted
SLOTS = 8
ENGINE_OPTIONS: dict[str, Any] = {}  # --compile: the engine-alone parts' EngineConfig(compile=True, ...)


def engine(model: Path, fair: bool) -> Engine:
    config = EngineConfig(
        model=str(model),
        max_batch_size=SLOTS,
        enable_prefix_caching=False,
        fair_share=WEIGHTS if fair else None,
        **ENGINE_OPTIONS,
    )
    return Engine(config)


def params(tenant: str, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, tenant=tenant)


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(n)]


def backlogged(model: Path, fair: bool, n: int, window: int) -> dict[str, float]:
    rng = random.Random(0)
    e = engine(model, fair)
    tenant_of: dict[str, str] = {}
    for tenant, (lo, hi) in (("long", (32, 64)), ("short", (8, 16))):
        for i in range(n):
            rid = f"{tenant}-{i}"
            tenant_of[rid] = tenant
            e.add_request(rid, prompt(rng, rng.randint(lo, hi)), params(tenant, rng.randint(lo, hi)))
    left = {"long": n, "short": n}
    started: set[str] = set()
    windows: list[dict[str, float]] = []
    current: dict[str, float] = defaultdict(float)
    steps, tokens, t0, cpu0 = 0, 0, time.perf_counter(), time.process_time()
    both_until = None  # seconds at which one tenant ran out of requests
    while e.has_unfinished():
        for d in e.step():
            tenant = tenant_of[d.request_id]
            if d.request_id not in started:
                started.add(d.request_id)
                current[tenant] += WEIGHTS.prompt * d.num_prompt_tokens
            current[tenant] += WEIGHTS.output * len(d.token_ids)
            tokens += len(d.token_ids)
            if d.finish_reason is not None:
                left[tenant] -= 1
        steps += 1
        if steps % window == 0:
            windows.append(dict(current))
            current = defaultdict(float)
        if both_until is None and min(left.values()) == 0:
            both_until = len(windows)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    both = windows[: both_until or len(windows)]
    a = sum(w.get("long", 0.0) for w in both)
    b = sum(w.get("short", 0.0) for w in both)
    gaps = [abs(w.get("long", 0.0) - w.get("short", 0.0)) for w in both]
    return {
        "jain": (a + b) ** 2 / (2 * (a * a + b * b)) if a or b else 1.0,
        "max_window_gap": max(gaps, default=0.0),
        "mean_window_service": (a + b) / (2 * len(both)) if both else 0.0,
        "tok_s": tokens / elapsed,
        "seconds": elapsed,
        # Less bent by other processes on the machine than the wall clock: tokens per step (the
        # batching the scheduler kept up) and per CPU second of this process (its own work).
        "tok_per_step": tokens / steps,
        "tok_per_cpu_s": tokens / cpu,
    }


def trickle_ttft(model: Path, fair: bool, flood: int, trickle: int) -> tuple[list[float], list[int]]:
    """The trickle tenant's TTFTs (s), one request at a time, beside ``flood`` short requests; and
    the engine steps each took to its first token (1: in the first step after it arrived)."""
    rng = random.Random(1)
    e = engine(model, fair)
    for i in range(flood):
        e.add_request(f"flood-{i}", prompt(rng, 8), params("flood", 8))
    ttfts, steps = [], []
    for i in range(trickle):
        rid, sent, first, n = f"trickle-{i}", time.perf_counter(), None, 0
        e.add_request(rid, prompt(rng, 16), params("trickle", 16))
        done = False
        while not done:
            deltas = e.step()
            n += 1
            for d in deltas:
                if d.request_id == rid:
                    if first is None and d.token_ids:
                        first = time.perf_counter() - sent
                        steps.append(n)
                    done = done or d.finish_reason is not None
        assert first is not None
        ttfts.append(first)
    return ttfts, steps


def pct(xs: Sequence[float], q: float) -> float:
    # NOTE: "inclusive": the default ("exclusive") extrapolates past the largest sample when there
    # are fewer than 100, which made a p99 of 15 TTFTs several times the slowest one.
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1] if len(xs) > 1 else xs[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200, help="backlogged: requests per tenant")
    ap.add_argument("--window", type=int, default=50, help="backlogged: steps per window")
    ap.add_argument("--flood", type=int, default=2000, help="flood: the flooding tenant's requests")
    ap.add_argument("--trickle", type=int, default=40, help="flood: the trickling tenant's requests")
    ap.add_argument("--repeats", type=int, default=3, help="backlogged: runs of each, alternating")
    ap.add_argument("--jobs", type=int, default=200, help="models: jobs per model")
    ap.add_argument("--job-tokens", type=int, default=16, help="models: max_tokens of each job")
    ap.add_argument(
        "--redis-url",
        help="models, service: run on this Redis, under a prefix of their own deleted at the end "
        "(default: a private redis-server)",
    )
    ap.add_argument("--json", type=Path, help="models: also write its figures as JSON here")
    ap.add_argument(
        "--worker-torch-threads",
        type=int,
        metavar="N",
        help="service: the worker's SPOOL_TORCH_THREADS (default: the CPUs minus one, as `spool up` "
        "gives its worker; the CPUs' count for torch's own default)",
    )
    ap.add_argument(
        "--parts",
        default="backlogged,flood,service,models",
        help="which parts to run, comma-separated: backlogged, flood, service, models (default: all)",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="backlogged, flood: the engine's compiled forward (the service's default on a CPU), "
        "compiled once into a temporary cache",
    )
    args = ap.parse_args()
    args.worker_torch_threads = args.worker_torch_threads or int(worker_torch_threads({}))
    with tempfile.TemporaryDirectory() as tmp:
        if args.compile:
            ENGINE_OPTIONS.update(compile=True, compile_cache_dir=str(Path(tmp) / "compile"))
        model = build_tiny_model(Path(tmp) / "tiny", "llama")
        engine(model, True).generate([[1, 2, 3]], params("", 4))  # warm-up (first forwards)
        parts = set(args.parts.split(","))
        if "backlogged" in parts:
            run_backlogged(model, args)
        if "flood" in parts:
            run_flood(model, args)
        if "service" in parts:
            run_service(model, args)
        if "models" in parts:
            figures = run_models(model, args)
            print_models(figures, args)
            if args.json:
                args.json.write_text(json.dumps(figures, indent=2) + "\n")


def run_backlogged(model: Path, args: argparse.Namespace) -> None:
    print(f"backlogged: 2 tenants x {args.requests} requests, {SLOTS} slots, windows of {args.window} steps")
    for fair in (False, True):  # untimed: a process's first engine run pays torch's first calls
        backlogged(model, fair, 8, args.window)
    repeats: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for _ in range(args.repeats):
        for fair in (False, True):
            repeats[fair].append(backlogged(model, fair, args.requests, args.window))
    for fair, rs in repeats.items():
        r = rs[0]  # the service per step does not depend on the run: the first one's windows
        print(
            f"  {'fair' if fair else 'FCFS'}: Jain {r['jain']:.3f} (target >= 0.95 fair), "
            f"largest gap in a window {r['max_window_gap']:.0f} (mean service per tenant and "
            f"window {r['mean_window_service']:.0f}), {r['tok_per_step']:.2f} tokens per step, tok/s "
            + ", ".join(f"{x['tok_s']:.0f} in {x['seconds']:.1f} s" for x in rs)
            + ", tokens per CPU second "
            + ", ".join(f"{x['tok_per_cpu_s']:.0f}" for x in rs)
        )
    for figure, what in (
        ("tok_s", "wall clock"),
        ("tok_per_cpu_s", "CPU time"),
        ("tok_per_step", "steps"),
    ):
        m = {fair: statistics.median(x[figure] for x in rs) for fair, rs in repeats.items()}
        print(f"throughput fair / FCFS by {what} (medians): {m[True] / m[False]:.3f} (target >= 0.95)")


def run_flood(model: Path, args: argparse.Namespace) -> None:
    idle, idle_steps = trickle_ttft(model, True, 0, args.trickle)
    print(f"flood: {args.flood} short requests; trickle: {args.trickle} one by one")
    print(
        f"  idle: trickle TTFT p50 {pct(idle, 50) * 1e3:.1f} ms, p99 {pct(idle, 99) * 1e3:.1f} ms, "
        f"steps to its first token p50 {pct(idle_steps, 50):.0f}, p99 {pct(idle_steps, 99):.0f}"
    )
    for fair in (False, True):
        t, steps = trickle_ttft(model, fair, args.flood, args.trickle)
        print(
            f"  {'fair' if fair else 'FCFS'}: trickle TTFT p50 {pct(t, 50) * 1e3:.1f} ms "
            f"({pct(t, 50) / pct(idle, 50):.2f}x idle), p99 {pct(t, 99) * 1e3:.1f} ms "
            f"({pct(t, 99) / pct(idle, 99):.2f}x idle; target within 1.5x fair); "
            f"steps to its first token p50 {pct(steps, 50):.0f}, p99 {pct(steps, 99):.0f}"
        )


# -- (b) through the service: two API keys, one worker -----------------------------------------

# Two API keys whose tenants hash to different tenant queues (Keys.tenant_queue), so that the
# broker does not put the trickle key's messages behind the flood's (that is what tenant queues
# are for; keys that share one are the broker's FCFS, not the engine's).
SERVICE_KEYS = {"flood": "bench-flood-key", "trickle": "bench-trickle-key-1"}
WORDS = "the quick brown fox jumps over a lazy dog while seven bold wizards quietly hex".split()


def run_service(model: Path, args: argparse.Namespace) -> None:
    """(b) through the whole service: a Redis (as for models), one `spool worker` (``SLOTS``
    slots, fair shares off, then on), one API with two API keys. "trickle" sends --trickle streamed
    completions one by one, first alone (idle), then while "flood" has --flood short jobs queued
    (POST /v1/jobs, 8 tokens each): TTFT from each POST to its first chunk, at the client."""
    keys = SERVICE_KEYS
    queue = Keys("x").model_queue(model.name)  # a directory's model is served by its name
    owner = {name: auth_owner(key) for name, key in keys.items()}
    assert Keys.tenant_queue(queue, tenant_of(owner["flood"])) != Keys.tenant_queue(
        queue, tenant_of(owner["trickle"])
    ), "the bench's two keys share a tenant queue: pick others"
    print(
        f"service (b): {args.flood} short jobs of one key, {args.trickle} streamed completions of "
        f"another one by one; one worker ({SLOTS} slots, {args.worker_torch_threads} torch threads), "
        "one API, TTFT at the client"
    )
    with tempfile.TemporaryDirectory(prefix="spool-fair-service-") as tmp:
        logs = Path(tmp)
        procs, url = [], args.redis_url
        try:
            if url is None:
                server, url = harness.start_redis(data_dir=logs, log_dir=logs)
                procs.append(server)
            for fair in (False, True):
                service_mode(model, url, fair, args, logs)
        finally:
            harness.stop_all(procs)


def service_mode(model: Path, url: str, fair: bool, args: argparse.Namespace, logs: Path) -> None:
    prefix = f"fairservice-{uuid.uuid4().hex[:8]}"
    # The queue holds the whole flood (the default SPOOL_MAX_QUEUED_JOBS, 1,000, answers 429 past
    # it, and SPOOL_MAX_QUEUED_JOBS_PER_KEY, 500, past one key's share).
    settings: dict[str, object] = {
        "api_keys": ",".join(SERVICE_KEYS.values()),
        "max_queued_jobs": 10 * args.flood,
        "max_queued_jobs_per_key": 10 * args.flood,
    }
    # NOTE: torch's default, a thread per core, leaves the API, Redis and the clients no core of
    # their own: each time they run, the step waits for the engine's preempted thread (on this
    # 2-core VM the trickle's first step beside the flood took 6.3 and 11.6 ms against 2.3 and 7.6 with one
    # thread, docs/benchmarks.md). `spool up` gives its worker the CPUs minus one for that reason.
    worker_env = harness.spool_env(
        url,
        prefix,
        model=model,
        max_batch_size=SLOTS,
        compile=False,
        fair_share=fair,
        torch_threads=args.worker_torch_threads,
        **settings,
    )
    procs = [
        harness.start(f"worker-{prefix}", [*harness.spool_argv(), "worker"], env=worker_env, log_dir=logs)
    ]
    try:
        api, api_url = harness.start_api(
            f"api-{prefix}", harness.spool_env(url, prefix, **settings), log_dir=logs
        )
        procs.append(api)
        served = {model.name: 1}  # a directory's model is served by its name
        harness.wait_until(
            lambda: live_models(api_url, SERVICE_KEYS["trickle"]) == served, "the worker", 300, procs
        )
        rng = random.Random(2)
        with httpx.Client(base_url=api_url, timeout=120) as client:
            trickle = {"Authorization": f"Bearer {SERVICE_KEYS['trickle']}"}
            service_ttft(client, trickle, rng)  # untimed: the first request's cold paths (~170 ms)
            idle = [service_ttft(client, trickle, rng) for _ in range(args.trickle)]
            flood = {"Authorization": f"Bearer {SERVICE_KEYS['flood']}"}
            with ThreadPoolExecutor(8) as pool:
                ids = list(pool.map(lambda _: flood_job(client, flood, random.Random(_)), range(args.flood)))
            loaded = [service_ttft(client, trickle, rng) for _ in range(args.trickle)]
            r = redis.Redis.from_url(url, decode_responses=True)
            with r.pipeline(transaction=False) as pipe:
                for job_id in ids:
                    pipe.hget(Keys(prefix).job(job_id), "status")
                waiting = sum(not JobStatus(s).terminal for s in pipe.execute())
        print(
            f"  {'fair' if fair else 'FCFS'}: idle TTFT p50 {pct(idle, 50) * 1e3:.1f} ms, p99 "
            f"{pct(idle, 99) * 1e3:.1f} ms; beside the flood p50 {pct(loaded, 50) * 1e3:.1f} ms "
            f"({pct(loaded, 50) / pct(idle, 50):.2f}x idle), p99 {pct(loaded, 99) * 1e3:.1f} ms "
            f"({pct(loaded, 99) / pct(idle, 99):.2f}x idle; target within 1.5x fair); "
            f"{waiting} of {len(ids)} flood jobs not yet ended after the last trickle request"
        )
    finally:
        harness.stop_all(procs)
        harness.delete_prefixes(redis.Redis.from_url(url), [prefix])


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def flood_job(client: httpx.Client, headers: dict[str, str], rng: random.Random) -> str:
    body = {"prompt": words(rng, 6), "max_tokens": 8, "temperature": 0}
    r = client.post("/v1/jobs", json=body, headers=headers)
    r.raise_for_status()
    return r.json()["id"]


def service_ttft(client: httpx.Client, headers: dict[str, str], rng: random.Random) -> float:
    """Seconds from a streamed completion's POST to its first chunk; the rest is read to its end."""
    body = {"prompt": words(rng, 12), "max_tokens": 16, "temperature": 0, "stream": True}
    sent, first = time.perf_counter(), None
    with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - sent
    assert first is not None, "no chunk"
    return first


# -- (d) two models, two workers ----------------------------------------------------------------

PROMPTS = ["the quick brown fox", "once upon a time", "in the beginning", "to be or not to be"]


def run_models(llama: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Two workers on one Redis, worker "a" on the tiny Llama, "b" on a tiny GPT-2 with a
    tokenizer of its own, and one API (uvicorn); ``--jobs`` completions for each model, sent
    interleaved and queued at once (background); then, per job, the model its view names and
    the worker its record names."""
    prefix = f"fairbench-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="spool-fair-bench-") as tmp:
        logs = Path(tmp)
        paths = {"a": llama, "b": build_tiny_model(logs / "tiny-gpt2", "gpt2", vocab_size=1024, seed=1)}
        procs: list[harness.Proc] = []
        url = args.redis_url
        try:
            if url is None:  # a private server, as the other benchmarks start
                server, url = harness.start_redis(data_dir=logs, log_dir=logs)
                procs.append(server)
            for name, path in paths.items():  # eager forward (no compile): the tests' workers
                env = harness.spool_env(
                    url,
                    prefix,
                    model=path,
                    worker_name=f"{prefix}-{name}",
                    max_batch_size=SLOTS,
                    compile=False,
                )
                argv = [*harness.spool_argv(), "worker"]
                procs.append(harness.start(f"worker-{name}", argv, env=env, log_dir=logs, cwd=REPO_ROOT))
            api, api_url = harness.start_api(
                "api", harness.spool_env(url, prefix), log_dir=logs, tree=REPO_ROOT
            )
            procs.append(api)
            served = {p.name: 1 for p in paths.values()}  # each directory's model by its name
            harness.wait_until(lambda: live_models(api_url) == served, "both models served", 300, procs)
            figures = models_jobs(
                api_url, redis.Redis.from_url(url, decode_responses=True), prefix, paths, args
            )
        finally:
            harness.stop_all(procs)
            if args.redis_url is not None:
                harness.delete_prefixes(redis.Redis.from_url(args.redis_url), [prefix])
    figures["prefix"] = prefix
    return figures


def live_models(api_url: str, key: str | None = None) -> dict[str, int]:
    """model -> live workers, as /v1/models lists them."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        listed = httpx.get(f"{api_url}/v1/models", headers=headers).json()["data"]
    except (httpx.HTTPError, KeyError, ValueError):
        return {}
    return {m["id"]: m.get("workers", 0) for m in listed}


def submit(api_url: str, model: str, prompt: str, max_tokens: int) -> str:
    """A background completion's job id (its stream closed at once: the job runs on)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    with httpx.stream(
        "POST", f"{api_url}/v1/completions", json={**body, "stream": True, "background": True}, timeout=60
    ) as r:
        r.raise_for_status()
        return r.headers["X-Spool-Job-Id"]


def models_jobs(
    api_url: str, r: redis.Redis, prefix: str, paths: dict[str, Path], args: argparse.Namespace
) -> dict[str, Any]:
    names = [name for _ in range(args.jobs) for name in paths]  # a, b, a, b, ...
    with ThreadPoolExecutor(16) as pool:
        ids = list(
            pool.map(
                lambda i: submit(api_url, str(paths[names[i]]), PROMPTS[i % len(PROMPTS)], args.job_tokens),
                range(len(names)),
            )
        )
    keys = Keys(prefix)

    def ended() -> bool:
        with r.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hget(keys.job(job_id), "status")
            return all(s is not None and JobStatus(s).terminal for s in pipe.execute())

    harness.wait_until(ended, f"{len(ids)} jobs to end", 60 + 2 * len(ids))
    with httpx.Client(base_url=api_url, timeout=60) as client, ThreadPoolExecutor(8) as pool:
        views = list(pool.map(lambda j: client.get(f"/v1/jobs/{j}").json(), ids))
    with r.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hget(keys.job(job_id), "worker")
        workers = pipe.execute()
    own = [
        v["status"] == "succeeded" and v["model"] == paths[n].name and w == f"{prefix}-{n}"
        for n, v, w in zip(names, views, workers, strict=True)
    ]
    wall = max(v["finished_at"] for v in views) - min(v["created_at"] for v in views)
    return {
        "jobs": len(ids),
        "on_own_model": sum(own),
        "per_model": {n: sum(o for m, o in zip(names, own, strict=True) if m == n) for n in paths},
        "succeeded": sum(v["status"] == "succeeded" for v in views),
        "wall_s": wall,
        "jobs_per_s": len(ids) / wall,
        "completion_tokens": sum(v["usage"]["completion_tokens"] for v in views),
    }


def print_models(m: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"models: 2 models, 2 workers ({SLOTS} slots each), {args.jobs} jobs each, {args.job_tokens} tokens"
    )
    print(
        f"  {m['on_own_model']} of {m['jobs']} jobs ran on their own model's worker "
        f"(a {m['per_model']['a']}, b {m['per_model']['b']}; {m['succeeded']} succeeded); "
        f"first submit to last end {m['wall_s']:.1f} s, {m['jobs_per_s']:.1f} jobs/s, "
        f"{m['completion_tokens'] / m['wall_s']:.0f} tok/s"
    )


if __name__ == "__main__":
    main()
