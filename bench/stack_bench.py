#!/usr/bin/env python
"""Spool full-stack benchmark: the engine benchmark's uniform workload through API + Redis + worker.

One run, three parts, all on a private ``redis-server`` and processes this script starts and stops:

throughput  The uniform workload of bench/engine_bench.py (its random ~58M-parameter Llama, 32
            prompts of 16..128 tokens, 64 new tokens each, all at once, max_batch_size 32, greedy,
            EOS unreachable) run through the engine alone (``Engine.add_request`` / ``step`` in
            this process) and through the full stack: one ``spool worker`` and one API
            (``uvicorn api.main:app``), 32 concurrent clients (asyncio: httpx for the POST, a
            bare socket for the stream) that each POST /v1/jobs and stream GET /v1/jobs/{id}/events. The two alternate for ``--rounds``
            rounds; the medians are reported.
ttft        Time to first token per request: the engine's from the moment all requests are
            added, the stack's from each client's POST to its first ``token`` event. The stack
            adds the difference of the percentiles (p50, p95).
connections ``--connections`` (1,000) SSE streams held open on one API process, on jobs queued
            with no worker to take them; every stream must stay open and receive the ``: ping``
            keep-alive. Prints that process's RSS before, with and after the streams.

Targets (printed next to the figures, never asserted): stack/engine tok/s >= 0.9; stack adds
<= 25 ms to the median time to first token. See docs/benchmarks.md.

    .venv/bin/python bench/stack_bench.py                    # full run (a few minutes on a quiet 2-core CPU)
    .venv/bin/python bench/stack_bench.py --quick            # smoke run: tiny model, 8 requests, 100 streams
    .venv/bin/python bench/stack_bench.py --small-model      # the full workload on the tiny model (GPU-like steps)
    .venv/bin/python bench/stack_bench.py --json /tmp/stack.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import resource
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import redis as redis_lib
import torch
import transformers
from measure import cpu_seconds, cpu_snapshot, loadavg, log, raise_fd_limit, rss_kib, thread_cpu_seconds
from stack_clients import Settled, Stream, hold, metric, parse_events, stream_job, submit
from stack_report import (
    Connections,
    Lone,
    Meta,
    Report,
    Round,
    RunResult,
    StackFigures,
    Summary,
    Throughput,
    Workload,
    print_report,
    summary_lines,
)
from transformers import AutoTokenizer

# workload puts the repository root on the module path: import it before the project's modules.
from workload import (
    DTYPES,
    FULL,
    QUICK,
    REPO_ROOT,
    Plan,
    build_model,
    quiet_libraries,
    spool_engine,
    text_prompts,
)

from common.schemas.requests import JobRequest
from spool_cli import procs as harness
from workers.engine import Engine, FinishReason
from workers.engine.tiny import make_eos_unreachable
from workers.job import sampling_params

BENCH_EOS = "<|bench_eos|>"
LONE_REPEATS = 11  # requests sent alone, one after the other, to each side
LONE_NEW_TOKENS = 4
PREFIX = "bench"  # key prefix of the throughput stack
CONN_PREFIX = "bench-conn"  # key prefix of the connections test (no worker consumes its queue)
START_TIMEOUT_S = 180.0  # a worker loads torch and the model before its first heartbeat
API_START_S = 60.0


# -- sizes ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StackPlan:
    engine: Plan  # engine_bench's plan: model size, uniform workload, warm-up slice, max_model_len
    rounds: int
    connections: int
    ping_s: float  # SPOOL_SSE_PING_S of the connections test's API
    hold_s: float  # how long the connections are held once all are open
    deadline_s: float  # the whole run stops (and cleans up) after this


FULL_STACK = StackPlan(FULL, rounds=5, connections=1000, ping_s=2.0, hold_s=10.0, deadline_s=1200.0)
QUICK_STACK = StackPlan(QUICK, rounds=1, connections=100, ping_s=1.0, hold_s=3.0, deadline_s=300.0)
# The full workload on the quick run's tiny model: engine steps of a few ms, as a real model's on
# a GPU, so what the stack adds is the service's own cost, not where a request fell among long steps.
SMALL_MODEL_STACK = replace(
    FULL_STACK,
    engine=replace(FULL, model=replace(QUICK.model, max_position_embeddings=FULL.decode_max_model_len)),
)


class BenchTimeout(Exception):
    pass


# -- where the processes run --------------------------------------------------------------------


class Placement:
    """Where the benchmark's processes run.

    Shared (the default): everything on every CPU, as on a one-box deployment; torch's threads
    then compete with the API, Redis and the clients. ``--engine-cpus K``: the engine (alone, and
    the worker process) on the first K CPUs with K torch threads, and the API, Redis and the
    clients on the others, as on a machine where the engine's compute has cores (or a GPU) of its
    own. This script runs both the engine alone and the clients, so it moves its own threads
    between the two sets before each run.
    """

    def __init__(self, engine_cpus: int | None) -> None:
        cpus = sorted(os.sched_getaffinity(0))
        self.engine: set[int] | None = None
        self.service: set[int] | None = None
        if engine_cpus is not None:
            if not 0 < engine_cpus < len(cpus):
                raise SystemExit(f"--engine-cpus must be 1..{len(cpus) - 1} here ({len(cpus)} CPUs)")
            self.engine, self.service = set(cpus[:engine_cpus]), set(cpus[engine_cpus:])
            torch.set_num_threads(engine_cpus)

    def describe(self) -> str:
        if self.engine is None:
            return "shared: engine, API, Redis and clients on all CPUs"
        return (
            f"split: engine on CPUs {sorted(self.engine)} ({len(self.engine)} torch threads); "
            f"API, Redis and clients on CPUs {sorted(self.service or ())}"
        )

    def engine_turn(self) -> None:
        _pin_this_process(self.engine)

    def clients_turn(self) -> None:
        _pin_this_process(self.service)

    def worker_env(self) -> dict[str, str]:
        return {} if self.engine is None else {"OMP_NUM_THREADS": str(len(self.engine))}


def _pin_this_process(cpus: set[int] | None) -> None:
    """Every thread of this process (torch's pool included) onto ``cpus``."""
    if cpus is None:
        return
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cpus)


# -- processes ----------------------------------------------------------------------------------


def start_api(
    procs: list[harness.Proc], log_dir: Path, name: str, env: dict[str, str], cpus: set[int] | None
) -> tuple[harness.Proc, str]:
    """``python -m uvicorn api.main:app`` of this checkout on a free port, once /healthz answers."""
    api, url = harness.start_api(name, env, log_dir=log_dir, tree=REPO_ROOT, cpus=cpus, timeout=API_START_S)
    procs.append(api)
    return api, url


@dataclass
class Stack:
    """The throughput part's processes: a worker, the clients' API replicas and one idle replica."""

    redis: harness.Proc
    redis_url: str
    worker: harness.Proc
    apis: list[harness.Proc]
    urls: list[str]
    idle_api: harness.Proc

    def pids(self) -> dict[str, list[int]]:
        return {
            "worker": [self.worker.pid],
            "api": [a.pid for a in self.apis],
            "idle_api": [self.idle_api.pid],
            "redis": [self.redis.pid],
        }

    def stop(self) -> None:
        harness.stop_all([self.idle_api, *self.apis, self.worker])


def worker_threads(args: argparse.Namespace) -> dict[str, str]:
    n = args.worker_torch_threads
    return {} if n is None else {"SPOOL_TORCH_THREADS": str(n)}


def start_stack(
    args: argparse.Namespace,
    place: Placement,
    procs: list[harness.Proc],
    log_dir: Path,
    redis: harness.Proc,
    redis_url: str,
    model_dir: Path,
    w: Workload,
) -> Stack:
    log(
        f"stack: starting a worker (max_batch_size={w.batch}, max_model_len={w.max_model_len}), an API and an idle replica"
    )
    env = harness.spool_env(
        redis_url,
        PREFIX,
        model=model_dir,
        device=args.device,
        dtype=args.dtype,
        max_batch_size=w.batch,
        max_model_len=w.max_model_len,
        worker_name=f"{PREFIX}-w1",
        compile=args.compile,  # as the engine alone, whatever the worker's default
        # peers_bench's --quantization (this script has none: the default, none)
        quantization=getattr(args, "quantization", "none"),
        **engine_settings(w),
    )
    argv = [*harness.spool_argv(), "worker"]
    worker_env = {**env, **place.worker_env(), **worker_threads(args)}
    worker = harness.start("worker", argv, env=worker_env, log_dir=log_dir, cwd=REPO_ROOT, cpus=place.engine)
    procs.append(worker)
    # The clients' replicas (round-robin, as behind a load balancer), and one that no client uses:
    # what it spends is what each replica pays for the others' streams (scale-out).
    apis = [start_api(procs, log_dir, f"api{i}", env, place.service) for i in range(args.api_replicas)]
    idle_api, _ = start_api(procs, log_dir, "idle_api", env, place.service)
    urls = [url for _, url in apis]
    harness.wait_until(
        lambda: harness.http_status(urls[0] + "/readyz") == 200,
        "the worker's heartbeat (/readyz)",
        START_TIMEOUT_S,
        [worker, *(a for a, _ in apis)],
    )
    return Stack(redis, redis_url, worker, [a for a, _ in apis], urls, idle_api)


# -- engine alone -------------------------------------------------------------------------------


def engine_run(engine: Engine, prompts: Sequence[str], max_tokens: int) -> RunResult:
    """Add every prompt at t0 (with the worker's sampling parameters), step until done; per-request TTFT."""
    params = sampling_params(
        JobRequest.model_validate({"prompt": "x", "max_tokens": max_tokens, "temperature": 0})
    )
    t0 = time.perf_counter()
    ids = [f"bench-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    n_prompt = [engine.add_request(rid, p, params) for rid, p in zip(ids, prompts, strict=True)]
    first: dict[str, float] = {}
    counts = dict.fromkeys(ids, 0)
    texts = dict.fromkeys(ids, "")
    reasons: dict[str, FinishReason | None] = {}
    while engine.has_unfinished():
        deltas = engine.step()
        now = time.perf_counter()
        for d in deltas:
            if d.token_ids and d.request_id not in first:
                first[d.request_id] = now
            counts[d.request_id] += len(d.token_ids)
            texts[d.request_id] += d.text
            if d.finished:
                reasons[d.request_id] = d.finish_reason
    seconds = time.perf_counter() - t0
    bad = {rid: (counts[rid], reasons.get(rid)) for rid in ids if counts[rid] != max_tokens}
    if bad or any(r is not FinishReason.LENGTH for r in reasons.values()):
        raise RuntimeError(f"engine: requests did not all generate {max_tokens} tokens: {bad or reasons}")
    tokens = sum(counts.values())
    return RunResult(
        tokens=tokens,
        seconds=seconds,
        tok_s=tokens / seconds,
        ttft_ms=[(first[rid] - t0) * 1e3 for rid in ids],
        prompt_tokens=n_prompt,
        texts=[texts[rid] for rid in ids],
    )


# -- the stack ----------------------------------------------------------------------------------


async def stack_run_async(
    urls: Sequence[str], prompts: Sequence[str], max_tokens: int, timeout: float, streamed: bool
) -> RunResult:
    """The prompts as concurrent clients, client i on API replica ``urls[i % len(urls)]``."""
    replicas = [httpx.URL(url) for url in urls]
    t0 = time.perf_counter()
    jobs = await asyncio.wait_for(
        asyncio.gather(
            *(stream_job(replicas[i % len(replicas)], p, max_tokens, streamed) for i, p in enumerate(prompts))
        ),
        timeout,
    )
    # Untimed: where each job's first token spent its time (the job's own timestamps).
    async with httpx.AsyncClient(base_url=urls[0], timeout=httpx.Timeout(timeout)) as client:
        views = await asyncio.gather(*(client.get(f"/v1/jobs/{j.job_id}") for j in jobs))
    phases: dict[str, list[float]] = {"api_ms": [], "queue_ms": [], "engine_ms": []}
    first_post = min(j.wall_start for j in jobs)
    taken: list[float] = []  # ms from the first POST to each job's start in the worker
    for j, v in zip(jobs, views, strict=True):
        job = v.json()
        if job.get("started_at"):
            taken.append((job["started_at"] - first_post) * 1e3)
        if j.wall_first_token is not None and job.get("started_at"):
            phases["api_ms"].append((job["created_at"] - j.wall_start) * 1e3)
            phases["queue_ms"].append((job["started_at"] - job["created_at"]) * 1e3)
            phases["engine_ms"].append((j.wall_first_token - job["started_at"]) * 1e3)
    end = max(j.end for j in jobs)
    events = [parse_events(j) for j in jobs]
    bad = [
        (i, e.token_events, e.done)
        for i, e in enumerate(events)
        if e.token_events != max_tokens
        or e.done.get("event") != "done"
        or e.done.get("finish_reason") != "length"
        or e.done["usage"]["completion_tokens"] != max_tokens
    ]
    if bad:
        raise RuntimeError(f"stack: jobs did not all generate {max_tokens} tokens: {bad[:3]}")
    tokens = sum(e.done["usage"]["completion_tokens"] for e in events)
    return RunResult(
        tokens=tokens,
        seconds=end - t0,
        tok_s=tokens / (end - t0),
        ttft_ms=[((j.first_token or j.end) - j.start) * 1e3 for j in jobs],
        submit_ms=[(j.submitted - j.start) * 1e3 for j in jobs],
        prompt_tokens=[e.done["usage"]["prompt_tokens"] for e in events],
        texts=[e.text for e in events],
        phases_p50_ms={k: statistics.median(v) for k, v in phases.items() if v},
        taken_ms=(min(taken), max(taken)) if taken else (math.nan, math.nan),
    )


def stack_run(
    urls: Sequence[str], prompts: Sequence[str], max_tokens: int, timeout: float, streamed: bool
) -> RunResult:
    return asyncio.run(stack_run_async(urls, prompts, max_tokens, timeout, streamed))


# -- throughput ---------------------------------------------------------------------------------


def workload_of(args: argparse.Namespace, plan: StackPlan, prompt_tokens: list[int]) -> Workload:
    ep = plan.engine
    return Workload(
        requests=len(prompt_tokens),
        prompt_tokens=prompt_tokens,
        new_tokens_each=ep.uniform_new_tokens,
        batch=ep.uniform_batch,
        max_model_len=args.max_model_len or ep.decode_max_model_len,
        max_prefill_tokens_per_step=args.max_prefill_tokens_per_step,
        rounds=args.rounds or plan.rounds,
        clients=len(prompt_tokens),
    )


def engine_settings(w: Workload) -> dict[str, int]:
    """The engine's default unless given, for the engine alone and the worker alike."""
    if w.max_prefill_tokens_per_step is None:
        return {}
    return {"max_prefill_tokens_per_step": w.max_prefill_tokens_per_step}


def load_engine(args: argparse.Namespace, model_dir: Path, w: Workload, compile: bool = False) -> Engine:
    log(f"engine: loading (max_batch_size={w.batch}, max_model_len={w.max_model_len}, compile={compile})")
    started = time.perf_counter()
    engine = spool_engine(model_dir, args, w.batch, w.max_model_len, compile=compile, **engine_settings(w))
    log(f"engine: loaded in {time.perf_counter() - started:.1f} s")
    if any(i < engine.runner.vocab_size for i in engine.eos_token_ids):
        raise RuntimeError(
            f"EOS {sorted(engine.eos_token_ids)} is reachable (vocab {engine.runner.vocab_size})"
        )
    return engine


@dataclass
class Sides:
    """The engine alone and the stack, each run with this process's threads on its CPUs."""

    engine: Engine
    urls: list[str]
    place: Placement
    streamed_submit: bool

    def run_engine(self, prompts: Sequence[str], max_tokens: int) -> RunResult:
        self.place.engine_turn()
        return engine_run(self.engine, prompts, max_tokens)

    def run_stack(self, prompts: Sequence[str], max_tokens: int, timeout: float) -> RunResult:
        self.place.clients_turn()
        return stack_run(self.urls, prompts, max_tokens, timeout, self.streamed_submit)


def one_round(sides: Sides, stack: Stack, prompts: Sequence[str], max_tokens: int, label: str) -> Round:
    log(f"round {label}: engine alone")
    e = sides.run_engine(prompts, max_tokens)
    log(f"round {label}: engine {e.tok_s:.1f} tok/s; stack with {len(prompts)} SSE clients")
    pids = stack.pids()
    with redis_lib.Redis.from_url(stack.redis_url) as r:
        r.config_resetstat()
        cpu0, threads0 = cpu_snapshot(pids), thread_cpu_seconds(stack.worker.pid)
        s = sides.run_stack(prompts, max_tokens, timeout=max(120.0, 20 * e.seconds))
        commands = redis_commands(r)
    cpu = {k: v - cpu0[k] for k, v in cpu_snapshot(pids).items()}
    threads = {k: v - threads0.get(k, 0.0) for k, v in thread_cpu_seconds(stack.worker.pid).items()}
    log(f"round {label}: stack {s.tok_s:.1f} tok/s ({s.tok_s / e.tok_s:.2f} of the engine)")
    if s.prompt_tokens != e.prompt_tokens:
        raise RuntimeError(f"prompt token counts differ: stack {s.prompt_tokens}, engine {e.prompt_tokens}")
    return Round.of(loadavg(), e, StackFigures.of_stack(s, e, cpu, threads, commands), s)


def redis_commands(r: redis_lib.Redis) -> int:
    """Commands Redis ran since CONFIG RESETSTAT, those scripts ran included, less this script's own."""
    stats = r.info("commandstats")
    ours = ("cmdstat_config|resetstat", "cmdstat_info")
    return sum(v["calls"] for k, v in stats.items() if k not in ours)


def lone_requests(sides: Sides, tokenizer: Any, prompts: Sequence[str], max_tokens: int) -> Lone:
    """The stack's fixed cost per request, without the batch's dynamics: one request at a time."""
    prompt = sorted(prompts, key=len)[len(prompts) // 2]
    new = min(max_tokens, LONE_NEW_TOKENS)
    log(f"lone requests: {LONE_REPEATS} x (engine, stack), {new} new tokens")
    engine_ms, stack_ms = [], []
    for _ in range(LONE_REPEATS):
        engine_ms.append(sides.run_engine([prompt], new).ttft_ms[0])
        stack_ms.append(sides.run_stack([prompt], new, timeout=60).ttft_ms[0])
    return Lone(len(tokenizer.encode(prompt)), new, engine_ms, stack_ms)


def throughput(
    args: argparse.Namespace,
    plan: StackPlan,
    place: Placement,
    procs: list[harness.Proc],
    log_dir: Path,
    redis: harness.Proc,
    redis_url: str,
    model_dir: Path,
) -> Throughput:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = text_prompts(plan.engine, args.seed, tokenizer)
    w = workload_of(args, plan, [len(tokenizer.encode(p)) for p in prompts])
    stack = start_stack(args, place, procs, log_dir, redis, redis_url, model_dir, w)
    engine = load_engine(args, model_dir, w, compile=args.compile)
    sides = Sides(engine, stack.urls, place, args.streamed_submit)

    warm_new = min(w.new_tokens_each, plan.engine.warmup_tokens)  # every prompt: every prefill shape
    log(f"engine: warm-up ({len(prompts)} prompts, {warm_new} new tokens each)")
    sides.run_engine(prompts, warm_new)
    log("stack: warm-up (the same)")
    sides.run_stack(prompts, warm_new, timeout=120)

    rounds = [
        one_round(sides, stack, prompts, w.new_tokens_each, f"{i + 1}/{w.rounds}") for i in range(w.rounds)
    ]
    lone = lone_requests(sides, tokenizer, prompts, w.new_tokens_each)
    stats = httpx.get(stack.urls[0] + "/readyz", timeout=5).json()["workers"][0]["engine"]
    stack.stop()
    return Throughput(
        workload=w,
        rounds=rounds,
        summary=Summary.of(rounds),
        lone=lone,
        worker_pid=stack.worker.pid,
        api_pids=[a.pid for a in stack.apis],
        streamed_submit=args.streamed_submit,
        engine_eos_token_ids=sorted(engine.eos_token_ids),
        model_vocab=engine.runner.vocab_size,
        worker_engine_stats=stats,
    )


# -- connections --------------------------------------------------------------------------------


async def hold_connections(
    url: str, pid: int, n: int, ping_s: float, hold_s: float, open_concurrency: int
) -> Connections:
    """Queue ``n`` jobs (no worker takes them), hold one SSE stream per job open, then close them."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=n + 16)
    timeout = httpx.Timeout(30.0, read=max(30.0, 10 * ping_s))
    async with (
        httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client,
        httpx.AsyncClient(base_url=url, timeout=10) as control,
    ):
        rss_idle = rss_kib(pid)["VmRSS"]
        log(f"connections: queueing {n} jobs")
        gate = asyncio.Semaphore(open_concurrency)
        job_ids = await asyncio.wait_for(asyncio.gather(*(submit(client, gate, i) for i in range(n))), 180)
        queued = await metric(control, "spool_queued_jobs")
        rss_before = rss_kib(pid)["VmRSS"]
        streams = [Stream(job_id) for job_id in job_ids]
        settled = Settled(n)

        log(f"connections: opening {n} SSE streams ({open_concurrency} at a time)")
        cpu0 = cpu_seconds(pid)
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(hold(client, gate, st, settled)) for st in streams]
        await asyncio.wait_for(settled.all.wait(), 180)
        all_open = time.perf_counter()
        opened = sum(st.open for st in streams)
        log(f"connections: {opened} open after {all_open - t0:.1f} s; holding them {hold_s:.0f} s")
        peak = 0
        hold_cpu0 = cpu_seconds(pid)
        while time.perf_counter() < all_open + hold_s:
            peak = max(peak, rss_kib(pid)["VmRSS"])
            await asyncio.sleep(0.5)
        hold_cpu_pct = 100 * (cpu_seconds(pid) - hold_cpu0) / (time.perf_counter() - all_open)
        server_streams = await metric(control, "spool_sse_streams")
        rss_with = rss_kib(pid)["VmRSS"]
        # What the streams saw, before they are closed.
        held = [st for st in streams if st.open and not st.ended]
        pinged = sum(any(t > all_open for t in st.pings) for st in held)
        min_pings = min(sum(t > all_open for t in st.pings) for st in streams)
        ended = [st.ended for st in streams if st.ended]
        other_comments = sum(st.other_comments for st in streams)
        cpu_total = cpu_seconds(pid) - cpu0

        log("connections: closing the streams")
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        left = await metric(control, "spool_sse_streams")
        deadline = time.perf_counter() + 15
        while left and time.perf_counter() < deadline:
            await asyncio.sleep(0.2)
            left = await metric(control, "spool_sse_streams")
    return Connections(
        connections=n,
        ping_s=ping_s,
        hold_s=hold_s,
        open_concurrency=open_concurrency,
        queued_jobs=queued,
        open_s=all_open - t0,
        opened=opened,
        refused_opens=sum(len(st.refused) for st in streams),
        refused_statuses=sorted({c for st in streams for c in st.refused}),
        held=len(held),
        pinged=pinged,
        min_pings_during_hold=min_pings,
        other_comments=other_comments,
        ended_early=len(ended),
        ended_examples=sorted(set(ended))[:5],
        server_streams=server_streams,
        server_streams_after_close=left,
        rss_kib_idle=rss_idle,
        rss_kib_before=rss_before,
        rss_kib_with=rss_with,
        rss_kib_peak_hold=max(peak, rss_with),
        rss_kib_after_close=rss_kib(pid)["VmRSS"],
        rss_kib_hwm=rss_kib(pid)["VmHWM"],
        api_cpu_hold_pct=hold_cpu_pct,
        api_cpu_s_total=cpu_total,
    )


def connections(
    args: argparse.Namespace,
    plan: StackPlan,
    place: Placement,
    procs: list[harness.Proc],
    log_dir: Path,
    redis_url: str,
) -> Connections:
    n = args.connections or plan.connections
    ping_s = args.ping_s or plan.ping_s
    hold_s = args.hold_s or plan.hold_s
    raise_fd_limit(n + 1024)
    # No worker on this prefix: the jobs stay queued and every stream stays open.
    env = harness.spool_env(redis_url, CONN_PREFIX, sse_ping_s=ping_s, max_queued_jobs=n + 100)
    api, url = start_api(procs, log_dir, "api-connections", env, place.service)
    place.clients_turn()
    c = asyncio.run(hold_connections(url, api.pid, n, ping_s, hold_s, args.open_concurrency))
    api.stop()
    # What went wrong inside the API (its own warnings), e.g. redis-py's connection pool running out.
    return replace(
        c,
        fd_soft_limit=resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        api_log_too_many_connections=api.log_tail(chars=10**9).count("Too many connections"),
    )


# -- main ---------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(
            "Run engine_bench's uniform workload through the full Spool stack (API + Redis + worker, "
            "32 concurrent SSE clients) and through the engine alone; print tok/s, their ratio and the "
            "time to first token the stack adds; hold many SSE streams on one API process and print its "
            "memory. Starts a private redis-server and its own processes, and stops them."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, 8 requests, 100 streams")
    p.add_argument(
        "--small-model",
        action="store_true",
        help="the full workload on the quick run's tiny model (0.6M parameters): steps of a few ms, as "
        "on a GPU, so the stack's overhead is the service's own",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the figures as JSON to PATH")
    p.add_argument("--device", default="cpu", help="torch device of the engine and the worker")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument(
        "--compile", action="store_true", help="the engine alone and the worker with the compiled forward"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed for the weights and the prompts (as engine_bench)"
    )
    p.add_argument("--rounds", type=int, help="engine/stack rounds, alternating (default 5; 1 with --quick)")
    p.add_argument("--connections", type=int, help="SSE streams to hold (default 1000; 100 with --quick)")
    p.add_argument("--ping-s", type=float, help="SPOOL_SSE_PING_S of that API (default 2; 1 with --quick)")
    p.add_argument("--open-concurrency", type=int, default=50, help="streams (and jobs) opened at a time")
    p.add_argument("--hold-s", type=float, help="seconds to hold the streams once all are open (default 10)")
    p.add_argument(
        "--max-model-len", type=int, help="engine and worker max_model_len (default 2048; 256 with --quick)"
    )
    p.add_argument(
        "--max-prefill-tokens-per-step",
        type=int,
        help="engine and worker prompt tokens per step (SPOOL_MAX_PREFILL_TOKENS_PER_STEP; default 2048)",
    )
    p.add_argument(
        "--engine-cpus",
        type=int,
        metavar="K",
        help="run the engine (alone, and the worker) on the first K CPUs with K torch threads, and the "
        "API, Redis and the clients on the others (default: all share every CPU)",
    )
    p.add_argument(
        "--worker-torch-threads",
        type=int,
        metavar="N",
        help="the worker's SPOOL_TORCH_THREADS (spool up's default: the CPUs minus one); default: "
        "torch's own, or K with --engine-cpus",
    )
    p.add_argument(
        "--api-replicas",
        type=int,
        default=1,
        metavar="N",
        help="API processes the throughput part's clients are spread over, round-robin (as behind a "
        "load balancer)",
    )
    p.add_argument(
        "--streamed-submit",
        action="store_true",
        help='each client makes one request, POST /v1/jobs with "stream": true, instead of a POST and '
        "then GET /v1/jobs/{id}/events",
    )
    p.add_argument(
        "--only", action="append", choices=("throughput", "connections"), help="run one part (repeatable)"
    )
    p.add_argument(
        "--deadline-s", type=float, help="stop everything after this long (default 1200; 300 quick)"
    )
    p.add_argument("--model-dir", type=Path, help="write the benchmark model here instead of a temp dir")
    p.add_argument("--keep-logs", type=Path, metavar="DIR", help="keep the processes' logs in DIR")
    args = p.parse_args(argv)
    if args.api_replicas < 1:
        p.error("--api-replicas must be at least 1")
    return args


def on_alarm(signum: int, frame: Any) -> None:
    raise BenchTimeout("the benchmark ran past --deadline-s")


def on_term(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def work_dirs(args: argparse.Namespace) -> Iterator[tuple[Path, Path, Path]]:
    with tempfile.TemporaryDirectory(prefix="spool-stack-bench-") as tmp:
        root = Path(tmp)
        model_dir = args.model_dir or root / "model"
        log_dir = args.keep_logs or root / "logs"
        for d in (model_dir, log_dir, root / "redis"):
            d.mkdir(parents=True, exist_ok=True)
        yield model_dir, log_dir, root / "redis"


def meta_of(args: argparse.Namespace, argv: Sequence[str] | None, place: Placement) -> Meta:
    return Meta(
        quick=args.quick,
        small_model=args.small_model,
        device=args.device,
        dtype=args.dtype,
        torch=torch.__version__,
        transformers=transformers.__version__,
        threads=torch.get_num_threads(),
        cpu_count=os.cpu_count(),
        placement=place.describe(),
        python=platform.python_version(),
        loadavg_start=loadavg(),
        seed=args.seed,
        command=" ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
    )


def model_info(model_dir: Path, plan: StackPlan, seed: int) -> dict[str, Any]:
    log(f"building the model in {model_dir}")
    params = build_model(model_dir, plan.engine.model, seed)
    eos = make_eos_unreachable(model_dir, BENCH_EOS)
    return {**asdict(plan.engine.model), "params": params, "params_m": params / 1e6, "eos_token_id": eos}


def main(argv: Sequence[str] | None = None) -> Report:
    args = parse_args(argv)
    quiet_libraries()
    plan = QUICK_STACK if args.quick else SMALL_MODEL_STACK if args.small_model else FULL_STACK
    parts = args.only or ["throughput", "connections"]
    place = Placement(args.engine_cpus)
    started = time.perf_counter()
    report = Report(meta_of(args, argv, place))
    log(f"parts {parts}; load average {report.meta.loadavg_start}; torch threads {torch.get_num_threads()}")
    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGTERM, on_term)
    signal.alarm(int(args.deadline_s or plan.deadline_s))
    try:
        with work_dirs(args) as (model_dir, log_dir, redis_dir):
            procs: list[harness.Proc] = []
            try:
                redis, redis_url = harness.start_redis(
                    "--maxclients", "10000", data_dir=redis_dir, log_dir=log_dir, cpus=place.service
                )
                procs.append(redis)
                log(f"private redis-server at {redis_url}")
                if "throughput" in parts:
                    report.meta.model = model_info(model_dir, plan, args.seed)
                    report.throughput = throughput(
                        args, plan, place, procs, log_dir, redis, redis_url, model_dir
                    )
                if "connections" in parts:
                    report.connections = connections(args, plan, place, procs, log_dir, redis_url)
            except BaseException:
                print(harness.log_tails(p for p in procs if p.name != "redis"), file=sys.stderr)
                raise
            finally:
                harness.stop_all(procs)
    finally:
        signal.alarm(0)

    report.meta.loadavg_end = loadavg()
    report.meta.wall_s = round(time.perf_counter() - started, 1)
    report.summary_lines = summary_lines(report)
    print_report(report)
    print(f"  (wall time {report.meta.wall_s} s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(asdict(report), indent=2) + "\n")
        log(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
