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
import random
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import h11
import httpx
import redis
import torch
import transformers

# engine_bench puts the repository root on sys.path and holds the model and the workloads.
from engine_bench import (
    DTYPES,
    FULL,
    QUICK,
    Plan,
    build_model,
    fmt,
    loadavg,
    log,
    quiet_libraries,
    random_prompts,
    ratio,
    spool_engine,
    verdict,
)
from transformers import AutoTokenizer

from common.schemas import JobRequest
from workers.engine import Engine, FinishReason
from workers.engine.tiny import make_eos_unreachable
from workers.runtime import sampling_params

REPO_ROOT = Path(__file__).resolve().parent.parent
TARGET_STACK_VS_ENGINE = 0.9  # stack tok/s >= 0.9 x engine tok/s
TARGET_ADDED_TTFT_P50_MS = 25.0  # stack p50 TTFT - engine p50 TTFT <= 25 ms
BENCH_EOS = "<|bench_eos|>"
LONE_REPEATS = 11  # requests sent alone, one after the other, to each side
LONE_NEW_TOKENS = 4
PREFIX = "bench"  # key prefix of the throughput stack
CONN_PREFIX = "bench-conn"  # key prefix of the connections test (no worker consumes its queue)
START_TIMEOUT_S = 180.0  # a worker loads torch and the model before its first heartbeat
LOG_TAIL_CHARS = 4000


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
    FULL_STACK, engine=replace(FULL, model=replace(QUICK.model, max_position_embeddings=FULL.decode_max_model_len))
)


class BenchTimeout(Exception):
    pass


# -- the model and the prompts ------------------------------------------------------------------


def single_token_words(tokenizer: Any) -> list[str]:
    """Words that the tokenizer turns into exactly one token when preceded by a space, sorted by id."""
    words = []
    for piece, token_id in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        word = piece[1:]
        plain = piece.startswith("\u0120") and word.isascii() and word.isalpha()  # "\u0120": byte-level space
        if plain and tokenizer.encode(" " + word, add_special_tokens=False) == [token_id]:
            words.append(word)
    return words


def text_prompts(plan: Plan, seed: int, tokenizer: Any) -> list[str]:
    """engine_bench's uniform prompts as text the job API accepts, with the same token counts.

    The prompts are engine_bench's (same seed, same lengths); each id past the first is replaced
    by a word that is one token after a space, and the tokenizer's BOS takes the first position,
    so the text encodes to exactly the engine benchmark's prompt length.
    """
    ids = random_prompts(
        random.Random(seed), plan.uniform_requests, plan.uniform_prompt_len, plan.model.vocab_size
    )
    words = single_token_words(tokenizer)
    prompts = ["".join(" " + words[i % len(words)] for i in p[1:]) for p in ids]
    for text, p in zip(prompts, ids, strict=True):
        n = len(tokenizer.encode(text, add_special_tokens=True))
        if n != len(p):
            raise RuntimeError(f"a prompt encodes to {n} tokens instead of {len(p)}: {text[:80]!r}")
    return prompts


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (q in [0, 100])."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# -- processes ----------------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM to its process group (Celery's threads and children go with it), then SIGKILL."""
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(5)


class Procs:
    """Starts processes in their own groups, logs in ``log_dir``; ``stop_all`` stops them in reverse."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[Proc] = []

    def start(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        cpus: set[int] | None = None,
        cwd: Path = REPO_ROOT,
    ) -> Proc:
        """``cpus``: the CPUs the process may run on (all of this process's, when None)."""
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("wb") as out:
            popen = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        if cpus is not None:
            # The child has just exec'd and has one thread; the threads it starts inherit this.
            os.sched_setaffinity(popen.pid, cpus)
        proc = Proc(name, popen, log_path)
        self.procs.append(proc)
        return proc

    def stop(self, proc: Proc) -> None:
        proc.stop()
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(list(self.procs)):
            self.stop(proc)


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(check: Any, what: str, timeout: float, watch: Sequence[Proc] = ()) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            if check():
                return
        for p in watch:
            if not p.alive():
                raise RuntimeError(
                    f"{p.name} exited ({p.popen.returncode}) while waiting for {what}:\n{p.log_tail()}"
                )
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.log_tail()}" for p in watch)
            raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}\n{tails}")
        time.sleep(0.1)


def spool_env(redis_url: str, prefix: str, **settings: object) -> dict[str, str]:
    """This environment without the caller's SPOOL_* variables, plus the given settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOOL_")}
    env.update(SPOOL_REDIS_URL=redis_url, SPOOL_REDIS_PREFIX=prefix, PYTHONUNBUFFERED="1")
    env.update({f"SPOOL_{k.upper()}": str(v) for k, v in settings.items()})
    return env


def start_redis(procs: Procs, work_dir: Path, cpus: set[int] | None) -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not on PATH; the benchmark runs its own private one")
    port = free_port()
    proc = procs.start(
        "redis",
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(work_dir), "--maxclients", "10000"],
        cpus=cpus,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    wait_until(lambda: client.ping(), "redis-server", 10, [proc])
    client.close()
    return url


def start_api(
    procs: Procs, name: str, env: dict[str, str], cpus: set[int] | None, tree: Path = REPO_ROOT
) -> tuple[Proc, str]:
    """``python -m uvicorn api.main:app`` of the checkout ``tree`` (its directory comes first on
    the module path), on a free port; returns once /healthz answers."""
    port = free_port()
    argv = [sys.executable, "-m", "uvicorn", "api.main:app", "--host", "127.0.0.1", "--port", str(port)]
    proc = procs.start(name, argv, env, cpus, cwd=tree)
    url = f"http://127.0.0.1:{port}"
    wait_until(
        lambda: httpx.get(url + "/healthz", timeout=2).status_code == 200, f"{name} /healthz", 60, [proc]
    )
    return proc, url


def spool_argv() -> list[str]:
    script = Path(sys.executable).with_name("spool")  # the console script of this venv
    return [str(script)] if script.exists() else [sys.executable, "-m", "spool_cli.main"]


def rss_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, in KiB, from /proc."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (its threads included), from /proc/PID/stat."""
    return stat_cpu_seconds(Path(f"/proc/{pid}/stat"))


def stat_cpu_seconds(stat: Path) -> float:
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds of a process's threads, summed by OS thread name (the worker names its own:
    ``spool-engine``, ``spool-writer``, ...; Celery's consumer and task threads keep the
    process's name)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            out[name] = out.get(name, 0.0) + stat_cpu_seconds(task / "stat")
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return out


def cpu_snapshot(pids: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds of each named group of processes, and of this one (the clients) as ``clients``."""
    return {**{name: sum(map(cpu_seconds, group)) for name, group in pids.items()}, "clients": time.process_time()}


def raise_fd_limit(needed: int) -> int:
    """Raise this process's soft open-files limit (children inherit it); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return int(soft)


# -- engine alone -------------------------------------------------------------------------------


@dataclass
class RunResult:
    """One timed run of the workload (engine alone or stack)."""

    tokens: int
    seconds: float
    tok_s: float
    ttft_ms: list[float]  # per request, in prompt order
    submit_ms: list[float] = field(default_factory=list)  # stack only: POST round trip
    prompt_tokens: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    phases_p50_ms: dict[str, float] = field(default_factory=dict)  # stack only: TTFT by phase
    taken_ms: tuple[float, float] = (0.0, 0.0)  # stack only: first and last job taken by the worker

    def summary(self) -> dict[str, float]:
        return {
            "tok_s": self.tok_s,
            "seconds": self.seconds,
            "ttft_p50_ms": percentile(self.ttft_ms, 50),
            "ttft_p95_ms": percentile(self.ttft_ms, 95),
        }


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


@dataclass
class JobTiming:
    job_id: str
    wall_start: float  # time.time(), to compare with the job's created_at / started_at
    wall_first_token: float | None
    start: float
    submitted: float
    first_token: float | None
    end: float
    body: bytes  # the event stream as received


async def stream_job(url: httpx.URL, prompt: str, max_tokens: int, streamed: bool) -> JobTiming:
    """Submit the job and read its event stream to the end (the server closes it after the
    terminal event), keeping the bytes and timestamping the first token event; ``parse_events``
    checks them after the round. ``streamed``: one request, ``POST /v1/jobs`` with ``"stream":
    true`` (its answer is the stream); else a POST, then ``GET /v1/jobs/{id}/events``."""
    request = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    wall_start, start = time.time(), time.perf_counter()
    if streamed:
        got = await bare_request(url, "/v1/jobs", {**request, "stream": True})
        job_id, submitted = got.location.rsplit("/", 1)[-1], got.answered
    else:
        job_id = json.loads((await bare_request(url, "/v1/jobs", request, expect=202)).body)["id"]
        submitted = time.perf_counter()
        got = await bare_request(url, f"/v1/jobs/{job_id}/events")
    end = time.perf_counter()
    return JobTiming(job_id, wall_start, got.wall_first_token, start, submitted, got.first_token, end, got.body)


FIRST_TOKEN_MARK = b"event: token\n"


@dataclass
class Received:
    body: bytes  # the answer's body (an event stream, or the job's JSON)
    answered: float  # perf_counter when the first bytes of the answer arrived
    first_token: float | None  # perf_counter when the first token event arrived
    wall_first_token: float | None  # the same, time.time()
    location: str  # the answer's Location header ("" if none)


async def bare_request(
    url: httpx.URL, path: str, json_body: dict[str, Any] | None = None, expect: int = 200
) -> Received:
    """GET ``path`` (POST ``json_body``, when given) on a connection of its own, and read the
    answer (an event stream, say) until the server closes it.

    NOTE: a plain asyncio connection, not httpx: httpx took about 0.15 ms of CPU per event, more
    in all than the API spent relaying them, and the clients share their CPU with the API and
    Redis. This only reads what the socket has, one call at a time; h11 (httpx's own HTTP/1.1
    parser) takes the framing apart after the round.
    """
    assert url.host and url.port
    http = h11.Connection(h11.CLIENT)
    headers = [("Host", f"{url.host}:{url.port}"), ("Connection", "close")]
    content = b"" if json_body is None else json.dumps(json_body).encode()
    if json_body is not None:
        headers += [("Content-Type", "application/json"), ("Content-Length", str(len(content)))]
    reader, writer = await asyncio.open_connection(url.host, url.port)
    raw: list[bytes] = []
    answered = math.nan
    first: float | None = None
    wall_first: float | None = None
    try:
        method = "GET" if json_body is None else "POST"
        writer.write(http.send(h11.Request(method=method, target=path, headers=headers)))
        if content:
            writer.write(http.send(h11.Data(data=content)) + http.send(h11.EndOfMessage()))
        tail = b""
        while chunk := await reader.read(1 << 16):
            if not raw:
                answered = time.perf_counter()
            raw.append(chunk)
            if first is None:
                # One SSE event is one HTTP chunk, so the mark is never cut by the chunk framing.
                if FIRST_TOKEN_MARK in tail + chunk:
                    first, wall_first = time.perf_counter(), time.time()
                tail = chunk[-len(FIRST_TOKEN_MARK) :]
    finally:
        writer.close()
    http.receive_data(b"".join(raw))
    http.receive_data(b"")  # the server closed the connection
    status, body, location = 0, [], ""
    while not isinstance(event := http.next_event(), h11.EndOfMessage | h11.NEED_DATA):
        if isinstance(event, h11.Response):
            status = event.status_code
            location = next((v.decode() for k, v in event.headers if k == b"location"), "")
        elif isinstance(event, h11.Data):
            body.append(event.data)
    if status != expect or event is h11.NEED_DATA:
        raise RuntimeError(
            f"{method} {path} answered {status} (complete: {event is not h11.NEED_DATA}): {b''.join(body)[:300]!r}"
        )
    return Received(b"".join(body), answered, first, wall_first, location)


@dataclass
class Events:
    token_events: int
    text: str
    done: dict[str, Any]


def parse_events(job: JobTiming) -> Events:
    """The job's stream, checked: ids consecutive from 1, token events, then one terminal event."""
    n, text, done, seq = 0, [], None, 0
    for block in job.body.decode().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if line and not line.startswith(":"))
        if not fields:
            continue
        seq += 1
        if done is not None or fields.get("id") != str(seq):
            raise RuntimeError(f"job {job.job_id}: event {fields} after id {seq - 1}")
        data = json.loads(fields["data"])
        if fields["event"] == "token":
            n += 1
            text.append(data["text"])
        else:
            done = {"event": fields["event"], **data}
    if done is None:
        raise RuntimeError(f"job {job.job_id}: the stream ended without a terminal event")
    return Events(n, "".join(text), done)


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


# -- connections --------------------------------------------------------------------------------


async def metric(client: httpx.AsyncClient, name: str) -> float:
    """One gauge of the API's /metrics (retried: /metrics reads Redis and can fail under load)."""
    for attempt in range(20):
        with contextlib.suppress(httpx.HTTPError):
            r = await client.get("/metrics")
            if r.status_code == 200:
                for line in r.text.splitlines():
                    if line.startswith(name + " "):
                        return float(line.split()[1])
                raise RuntimeError(f"/metrics has no {name}")
        await asyncio.sleep(0.25)
    raise RuntimeError(f"/metrics kept failing while reading {name}")


@dataclass
class Stream:
    job_id: str
    refused: list[int] = field(default_factory=list)  # HTTP statuses of refused opens (retried)
    open: bool = False
    pings: list[float] = field(default_factory=list)  # perf_counter of each ": ping"
    other_comments: int = 0  # e.g. ": redis unreachable; retrying"
    ended: str = ""  # why it ended before we closed it


OPEN_TRIES = 5


async def hold_connections(
    url: str, pid: int, n: int, ping_s: float, hold_s: float, open_concurrency: int
) -> dict[str, Any]:
    """Queue ``n`` jobs (no worker takes them), hold one SSE stream per job open, then close them."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=n + 16)
    timeout = httpx.Timeout(30.0, read=max(30.0, 10 * ping_s))
    out: dict[str, Any] = {
        "connections": n,
        "ping_s": ping_s,
        "hold_s": hold_s,
        "open_concurrency": open_concurrency,
    }
    async with (
        httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client,
        httpx.AsyncClient(base_url=url, timeout=10) as control,
    ):
        out["rss_kib_idle"] = rss_kib(pid)["VmRSS"]
        log(f"connections: queueing {n} jobs")
        gate = asyncio.Semaphore(open_concurrency)

        async def submit(i: int) -> str:
            async with gate:
                for _ in range(OPEN_TRIES):
                    r = await client.post("/v1/jobs", json={"prompt": f" job {i}", "max_tokens": 8})
                    if r.status_code == 202:
                        return str(r.json()["id"])
                    await asyncio.sleep(0.5)
                raise RuntimeError(f"POST /v1/jobs answered {r.status_code}: {r.text[:300]}")

        job_ids = await asyncio.wait_for(asyncio.gather(*(submit(i) for i in range(n))), 180)
        out["queued_jobs"] = await metric(control, "spool_queued_jobs")
        out["rss_kib_before"] = rss_kib(pid)["VmRSS"]
        streams = [Stream(job_id) for job_id in job_ids]
        settled = 0  # streams open, or given up on
        all_settled = asyncio.Event()

        def settle() -> None:
            nonlocal settled
            settled += 1
            if settled == n:
                all_settled.set()

        async def hold(st: Stream) -> None:
            counted = False
            try:
                for _ in range(OPEN_TRIES):
                    async with gate:
                        resp = await client.send(
                            client.build_request("GET", f"/v1/jobs/{st.job_id}/events"), stream=True
                        )
                    try:
                        if resp.status_code != 200:
                            st.refused.append(resp.status_code)
                            await resp.aread()
                            await asyncio.sleep(0.5)
                            continue
                        st.open, counted = True, True
                        settle()
                        async for line in resp.aiter_lines():
                            if line == ": ping":
                                st.pings.append(time.perf_counter())
                            elif line.startswith(":"):
                                st.other_comments += 1
                            elif line.startswith("event:"):
                                st.ended = line
                                return
                        st.ended = "the server closed the stream"
                        return
                    finally:
                        await resp.aclose()
                st.ended = f"refused {OPEN_TRIES} times: {st.refused}"
            except (httpx.HTTPError, OSError, ValueError) as e:
                st.ended = f"{type(e).__name__}: {e}"
            finally:
                if not counted:
                    settle()

        log(f"connections: opening {n} SSE streams ({open_concurrency} at a time)")
        cpu0 = cpu_seconds(pid)
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(hold(st)) for st in streams]
        await asyncio.wait_for(all_settled.wait(), 180)
        all_open = time.perf_counter()
        out["open_s"] = all_open - t0
        out["opened"] = sum(st.open for st in streams)
        out["refused_opens"] = sum(len(st.refused) for st in streams)
        out["refused_statuses"] = sorted({c for st in streams for c in st.refused})
        log(f"connections: {out['opened']} open after {out['open_s']:.1f} s; holding them {hold_s:.0f} s")
        peak = 0
        hold_cpu0 = cpu_seconds(pid)
        while time.perf_counter() < all_open + hold_s:
            peak = max(peak, rss_kib(pid)["VmRSS"])
            await asyncio.sleep(0.5)
        out["api_cpu_hold_pct"] = 100 * (cpu_seconds(pid) - hold_cpu0) / (time.perf_counter() - all_open)
        out["server_streams"] = await metric(control, "spool_sse_streams")
        out["rss_kib_with"] = rss_kib(pid)["VmRSS"]
        out["rss_kib_peak_hold"] = max(peak, out["rss_kib_with"])
        out["held"] = sum(st.open and not st.ended for st in streams)
        out["pinged"] = sum(
            st.open and not st.ended and any(t > all_open for t in st.pings) for st in streams
        )
        out["min_pings_during_hold"] = min(sum(t > all_open for t in st.pings) for st in streams)
        out["other_comments"] = sum(st.other_comments for st in streams)
        out["ended_early"] = sum(bool(st.ended) for st in streams)
        out["ended_examples"] = sorted({st.ended for st in streams if st.ended})[:5]
        out["api_cpu_s_total"] = cpu_seconds(pid) - cpu0

        log("connections: closing the streams")
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        left = await metric(control, "spool_sse_streams")
        deadline = time.perf_counter() + 15
        while left and time.perf_counter() < deadline:
            await asyncio.sleep(0.2)
            left = await metric(control, "spool_sse_streams")
        out["server_streams_after_close"] = left
        out["rss_kib_after_close"] = rss_kib(pid)["VmRSS"]
        out["rss_kib_hwm"] = rss_kib(pid)["VmHWM"]
    out["per_stream_kib"] = (out["rss_kib_with"] - out["rss_kib_before"]) / max(out["held"], 1)
    return out


# -- report -------------------------------------------------------------------------------------


def median_of(rounds: list[dict[str, Any]], side: str, key: str) -> float:
    return statistics.median(r[side][key] for r in rounds)


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    for side in ("engine", "stack"):
        for key in ("tok_s", "seconds", "ttft_p50_ms", "ttft_p95_ms"):
            s[f"{side}_{key}"] = median_of(rounds, side, key)
    s["stack_submit_p50_ms"] = median_of(rounds, "stack", "submit_p50_ms")
    s["stack_first_taken_ms"] = median_of(rounds, "stack", "first_taken_ms")
    s["stack_last_taken_ms"] = median_of(rounds, "stack", "last_taken_ms")
    phases = rounds[0]["stack"]["ttft_phases_p50_ms"]
    s["stack_ttft_phases_p50_ms"] = {
        k: statistics.median(r["stack"]["ttft_phases_p50_ms"][k] for r in rounds) for k in phases
    }
    s["stack/engine"] = ratio(s["stack_tok_s"], s["engine_tok_s"])
    s["added_ttft_p50_ms"] = s["stack_ttft_p50_ms"] - s["engine_ttft_p50_ms"]
    s["added_ttft_p95_ms"] = s["stack_ttft_p95_ms"] - s["engine_ttft_p95_ms"]
    s["stack_cpu_s"] = {
        k: statistics.median(r["stack"]["cpu_s"][k] for r in rounds) for k in rounds[0]["stack"]["cpu_s"]
    }
    thread_names = {k for r in rounds for k in r["stack"]["worker_threads_cpu_s"]}
    per_thread = {
        k: statistics.median(r["stack"]["worker_threads_cpu_s"].get(k, 0.0) for r in rounds) for k in thread_names
    }
    s["worker_threads_cpu_s"] = dict(sorted(per_thread.items(), key=lambda kv: -kv[1]))
    s["same_text_as_engine_min"] = min(r["stack"]["same_text_as_engine"] for r in rounds)
    s["meets_throughput_target"] = (
        s["stack/engine"] is not None and s["stack/engine"] >= TARGET_STACK_VS_ENGINE
    )
    s["meets_ttft_target"] = s["added_ttft_p50_ms"] <= TARGET_ADDED_TTFT_P50_MS
    return s


def print_report(report: dict[str, Any]) -> None:
    meta = report["meta"]
    print()
    model = f"{meta['model']['params_m']:.1f}M-param Llama (random), " if "model" in meta else ""
    print(
        f"Spool stack benchmark: {model}{meta['dtype']}, {meta['device']}, torch {meta['torch']} "
        f"({meta['threads']} threads), {meta['cpu_count']} CPUs"
    )
    print(f"placement {meta['placement']}")
    print(
        f"load average at start {meta['loadavg_start']}, at end {meta['loadavg_end']}"
        + (" (QUICK)" if meta["quick"] else "")
        + (" (SMALL MODEL)" if meta.get("small_model") else "")
    )
    if "workload" in report:
        w = report["workload"]
        print(
            f"workload: {w['requests']} prompts of {w['prompt_tokens_min']}..{w['prompt_tokens_max']} tokens "
            f"({w['prompt_tokens_total']} in all), {w['new_tokens_each']} new tokens each, all at once, "
            f"max_batch_size {w['batch']}, max_model_len {w['max_model_len']}, greedy, EOS unreachable; "
            f"{w['rounds']} rounds, medians"
        )
    if "rounds" in report:
        print()
        print(
            f"  {'round':<7} {'engine tok/s':>12} {'stack tok/s':>12} {'ratio':>6}   "
            f"{'TTFT p50/p95 ms: engine':>24} {'stack':>11}   same text  load 1m"
        )
        n = report["workload"]["requests"]
        for i, r in enumerate(report["rounds"], 1):
            e, s = r["engine"], r["stack"]
            print(
                f"  {i:<7} {e['tok_s']:>12.1f} {s['tok_s']:>12.1f} {s['tok_s'] / e['tok_s']:>6.2f}   "
                f"{e['ttft_p50_ms']:>14.0f}/{e['ttft_p95_ms']:<9.0f} {s['ttft_p50_ms']:>5.0f}/{s['ttft_p95_ms']:<5.0f}"
                f"   {s['same_text_as_engine']:>4}/{n:<4}  {(r['loadavg'] or ['-'])[0]}"
            )
    print()
    print("== summary")
    for line in report["summary_lines"]:
        print(f"  {line}")


def summary_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    if "summary" in report:
        s = report["summary"]
        clients = f"{report['workload']['clients']} SSE clients"
        if (replicas := report["meta"]["api_replicas"]) > 1:
            clients += f", {replicas} APIs"
        if report["meta"]["streamed_submit"]:
            clients += ", streamed submit"
        lone = report["lone"]
        lines += [
            (
                f"{'engine alone':<28} {s['engine_tok_s']:>9.1f} tok/s   TTFT p50 {s['engine_ttft_p50_ms']:7.1f} ms"
                f"   p95 {s['engine_ttft_p95_ms']:7.1f} ms"
            ),
            (
                f"{f'full stack ({clients})':<28} {s['stack_tok_s']:>9.1f} tok/s   TTFT p50 {s['stack_ttft_p50_ms']:7.1f} ms"
                f"   p95 {s['stack_ttft_p95_ms']:7.1f} ms   (POST p50 {s['stack_submit_p50_ms']:.1f} ms)"
            ),
            f"{'stack/engine tok/s':<28} {fmt(s['stack/engine']):>9}         target >= {TARGET_STACK_VS_ENGINE}"
            + verdict(s["meets_throughput_target"]),
            f"{'stack TTFT by phase (p50s)':<28} "
            + ", ".join(f"{k[:-3]} {v:.1f} ms" for k, v in s["stack_ttft_phases_p50_ms"].items())
            + "   (api: POST to job stored; queue: stored to taken by the worker; engine: taken to "
            "first token at the client)",
            f"{'CPU seconds per stack run':<28} "
            + ", ".join(f"{k} {v:.2f}" for k, v in s["stack_cpu_s"].items())
            + f"   (wall {s['stack_seconds']:.2f} s, {report['meta']['cpu_count']} CPUs)",
            f"{'worker threads, CPU s/run':<28} "
            + ", ".join(f"{k} {v:.2f}" for k, v in s["worker_threads_cpu_s"].items() if v >= 0.005)
            + "   (by OS thread name; Celery's consumer and task threads carry the process's)",
            (
                f"{'jobs reaching the worker':<28} first {s['stack_first_taken_ms']:.1f} ms, last "
                f"{s['stack_last_taken_ms']:.1f} ms after the first POST (the engine alone has them all at 0)"
            ),
            (
                f"{'lone request (median of ' + str(len(lone['stack_ttft_ms'])) + ')':<28} TTFT engine "
                f"{lone['engine_ttft_p50_ms']:.1f} ms, stack {lone['stack_ttft_p50_ms']:.1f} ms: the stack adds "
                f"{lone['added_ttft_p50_ms']:.1f} ms to a request alone ({lone['prompt_tokens']} prompt tokens)"
            ),
            f"{'TTFT added by the stack':<28} p50 {s['added_ttft_p50_ms']:+.1f} ms, p95 {s['added_ttft_p95_ms']:+.1f} ms"
            f"   target p50 <= {TARGET_ADDED_TTFT_P50_MS:.0f} ms" + verdict(s["meets_ttft_target"]),
        ]
    if "connections" in report:
        c = report["connections"]
        ok = c["held"] == c["pinged"] == c["connections"] and not c["refused_opens"]
        lines += [
            f"{'SSE connections held':<28} {c['held']}/{c['connections']} held, {c['pinged']} pinged during "
            f"{c['hold_s']:.0f} s (ping {c['ping_s']:g} s); all open after {c['open_s']:.1f} s; "
            + (
                f"{c['refused_opens']} opens refused {c['refused_statuses']} and retried; "
                if c["refused_opens"]
                else "no open refused; "
            )
            + f"{c['ended_early']} ended early; server counted {c['server_streams']:.0f}, "
            f"{c['server_streams_after_close']:.0f} after close" + ("" if ok else "  [NOT ALL HELD CLEANLY]"),
            (
                f"{'API process RSS':<28} {c['rss_kib_before'] / 1024:.1f} MiB before (jobs queued), "
                f"{c['rss_kib_with'] / 1024:.1f} MiB with the streams "
                f"(+{c['per_stream_kib']:.1f} KiB/stream), {c['rss_kib_after_close'] / 1024:.1f} MiB after close; "
                f"API CPU while holding {c['api_cpu_hold_pct']:.0f}% of a core"
            ),
        ]
        if c["api_log_too_many_connections"] or c["other_comments"]:
            lines.append(
                f"{'API Redis pool errors':<28} {c['api_log_too_many_connections']} 'Too many connections' in "
                f"the API log, {c['other_comments']} non-ping comments (Redis retries) on the streams"
            )
    return lines


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


def throughput(
    args: argparse.Namespace,
    plan: StackPlan,
    place: Placement,
    procs: Procs,
    redis_url: str,
    model_dir: Path,
    report: dict[str, Any],
) -> None:
    ep = plan.engine
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = text_prompts(ep, args.seed, tokenizer)
    n_new, batch = ep.uniform_new_tokens, ep.uniform_batch
    max_model_len = args.max_model_len or ep.decode_max_model_len
    prefill = {}  # the engine's default unless given, for the engine alone and the worker alike
    if args.max_prefill_tokens_per_step:
        prefill["max_prefill_tokens_per_step"] = args.max_prefill_tokens_per_step
    warm_new = min(n_new, ep.warmup_tokens)  # the warm-ups run every prompt (every prefill shape)
    rounds = args.rounds or plan.rounds
    lengths = [len(tokenizer.encode(p)) for p in prompts]
    report["workload"] = {
        "requests": len(prompts),
        "prompt_tokens": lengths,
        "prompt_tokens_min": min(lengths),
        "prompt_tokens_max": max(lengths),
        "prompt_tokens_total": sum(lengths),
        "new_tokens_each": n_new,
        "batch": batch,
        "max_model_len": max_model_len,
        **prefill,
        "rounds": rounds,
        "clients": len(prompts),
    }

    log(f"stack: starting a worker (max_batch_size={batch}, max_model_len={max_model_len}), an API and an idle replica")
    env = spool_env(
        redis_url,
        PREFIX,
        model=model_dir,
        device=args.device,
        dtype=args.dtype,
        max_batch_size=batch,
        max_model_len=max_model_len,
        worker_name=f"{PREFIX}-w1",
        **prefill,
    )
    worker = procs.start("worker", spool_argv() + ["worker"], {**env, **place.worker_env()}, place.engine)
    # The clients' replicas (round-robin, as behind a load balancer), and one that no client uses:
    # what it spends is what each replica pays for the others' streams (scale-out).
    apis = [start_api(procs, f"api{i}", env, place.service) for i in range(args.api_replicas)]
    urls = [url for _, url in apis]
    idle_api, _ = start_api(procs, "idle_api", env, place.service)

    def ready() -> bool:
        return httpx.get(urls[0] + "/readyz", timeout=2).status_code == 200

    wait_until(ready, "the worker's heartbeat (/readyz)", START_TIMEOUT_S, [worker, *(a for a, _ in apis)])
    report["meta"]["worker_pid"], report["meta"]["api_pids"] = worker.pid, [a.pid for a, _ in apis]
    report["meta"]["api_replicas"] = args.api_replicas
    report["meta"]["streamed_submit"] = args.streamed_submit
    redis_pid = next(p.pid for p in procs.procs if p.name == "redis")
    pids = {"worker": [worker.pid], "api": [a.pid for a, _ in apis], "idle_api": [idle_api.pid], "redis": [redis_pid]}

    log(f"engine: loading (max_batch_size={batch}, max_model_len={max_model_len})")
    engine = spool_engine(model_dir, args, batch, max_model_len, **prefill)
    report["meta"]["engine_eos_token_ids"] = sorted(engine.eos_token_ids)
    report["meta"]["model_vocab"] = engine.runner.vocab_size
    if any(i < engine.runner.vocab_size for i in engine.eos_token_ids):
        raise RuntimeError(
            f"EOS {sorted(engine.eos_token_ids)} is reachable (vocab {engine.runner.vocab_size})"
        )

    def engine_side(prompts: Sequence[str], max_tokens: int) -> RunResult:
        place.engine_turn()
        return engine_run(engine, prompts, max_tokens)

    def stack_side(prompts: Sequence[str], max_tokens: int, timeout: float) -> RunResult:
        place.clients_turn()
        return stack_run(urls, prompts, max_tokens, timeout, args.streamed_submit)

    log(f"engine: warm-up ({len(prompts)} prompts, {warm_new} new tokens each)")
    engine_side(prompts, warm_new)
    log("stack: warm-up (the same)")
    stack_side(prompts, warm_new, timeout=120)

    results = []
    for i in range(rounds):
        log(f"round {i + 1}/{rounds}: engine alone")
        e = engine_side(prompts, n_new)
        log(f"round {i + 1}/{rounds}: engine {e.tok_s:.1f} tok/s; stack with {len(prompts)} SSE clients")
        cpu0, threads0 = cpu_snapshot(pids), thread_cpu_seconds(worker.pid)
        s = stack_side(prompts, n_new, timeout=max(120.0, 20 * e.seconds))
        cpu = {k: v - cpu0[k] for k, v in cpu_snapshot(pids).items()}
        threads = {k: v - threads0.get(k, 0.0) for k, v in thread_cpu_seconds(worker.pid).items()}
        log(f"round {i + 1}/{rounds}: stack {s.tok_s:.1f} tok/s ({s.tok_s / e.tok_s:.2f} of the engine)")
        if s.prompt_tokens != e.prompt_tokens:
            raise RuntimeError(
                f"prompt token counts differ: stack {s.prompt_tokens}, engine {e.prompt_tokens}"
            )
        results.append(
            {
                "loadavg": loadavg(),
                "engine": {**e.summary(), "ttft_ms": e.ttft_ms},
                "stack": {
                    **s.summary(),
                    "submit_p50_ms": percentile(s.submit_ms, 50),
                    "ttft_phases_p50_ms": s.phases_p50_ms,
                    "first_taken_ms": s.taken_ms[0],
                    "last_taken_ms": s.taken_ms[1],
                    "ttft_ms": s.ttft_ms,
                    "submit_ms": s.submit_ms,
                    "same_text_as_engine": sum(a == b for a, b in zip(s.texts, e.texts, strict=True)),
                    "cpu_s": cpu,
                    "worker_threads_cpu_s": threads,
                },
            }
        )
    report["rounds"] = results
    report["summary"] = summarize(results)

    # The stack's fixed cost per request, without the batch's dynamics: one request at a time.
    lone_prompt = sorted(prompts, key=len)[len(prompts) // 2]
    lone_new = min(n_new, LONE_NEW_TOKENS)
    log(f"lone requests: {LONE_REPEATS} x (engine, stack), {lone_new} new tokens")
    lone_e, lone_s = [], []
    for _ in range(LONE_REPEATS):
        lone_e.append(engine_side([lone_prompt], lone_new).ttft_ms[0])
        lone_s.append(stack_side([lone_prompt], lone_new, timeout=60).ttft_ms[0])
    report["lone"] = {
        "prompt_tokens": len(tokenizer.encode(lone_prompt)),
        "new_tokens": lone_new,
        "engine_ttft_ms": lone_e,
        "stack_ttft_ms": lone_s,
        "engine_ttft_p50_ms": statistics.median(lone_e),
        "stack_ttft_p50_ms": statistics.median(lone_s),
        "added_ttft_p50_ms": statistics.median(lone_s) - statistics.median(lone_e),
    }
    stats = httpx.get(urls[0] + "/readyz", timeout=5).json()["workers"][0]["engine"]
    report["meta"]["worker_engine_stats"] = stats
    for proc in (idle_api, *(a for a, _ in apis), worker):
        procs.stop(proc)


def connections(
    args: argparse.Namespace,
    plan: StackPlan,
    place: Placement,
    procs: Procs,
    redis_url: str,
    report: dict[str, Any],
) -> None:
    n = args.connections or plan.connections
    ping_s = args.ping_s or plan.ping_s
    hold_s = args.hold_s or plan.hold_s
    raise_fd_limit(n + 1024)
    # No worker on this prefix: the jobs stay queued and every stream stays open.
    env = spool_env(redis_url, CONN_PREFIX, sse_ping_s=ping_s, max_queued_jobs=n + 100)
    api, url = start_api(procs, "api-connections", env, place.service)
    place.clients_turn()
    c = asyncio.run(hold_connections(url, api.pid, n, ping_s, hold_s, args.open_concurrency))
    c["fd_soft_limit"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    procs.stop(api)
    # What went wrong inside the API (its own warnings), e.g. redis-py's connection pool running out.
    api_log = api.log_path.read_text(errors="replace")
    c["api_log_too_many_connections"] = api_log.count("Too many connections")
    report["connections"] = c


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


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    quiet_libraries()
    plan = QUICK_STACK if args.quick else SMALL_MODEL_STACK if args.small_model else FULL_STACK
    parts = args.only or ["throughput", "connections"]
    place = Placement(args.engine_cpus)
    started = time.perf_counter()
    load_start = loadavg()
    log(f"parts {parts}; load average {load_start}; torch threads {torch.get_num_threads()}")
    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGTERM, on_term)
    signal.alarm(int(args.deadline_s or plan.deadline_s))

    report: dict[str, Any] = {
        "meta": {
            "quick": args.quick,
            "small_model": args.small_model,
            "device": args.device,
            "dtype": args.dtype,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "placement": place.describe(),
            "python": platform.python_version(),
            "loadavg_start": load_start,
            "seed": args.seed,
            "command": " ".join(
                [Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]
            ),
        },
        "targets": {
            "stack/engine tok/s >=": TARGET_STACK_VS_ENGINE,
            "added TTFT p50 ms <=": TARGET_ADDED_TTFT_P50_MS,
        },
    }
    try:
        with work_dirs(args) as (model_dir, log_dir, redis_dir):
            procs = Procs(log_dir)
            try:
                redis_url = start_redis(procs, redis_dir, place.service)
                log(f"private redis-server at {redis_url}")
                if "throughput" in parts:
                    log(f"building the model in {model_dir}")
                    params = build_model(model_dir, plan.engine.model, args.seed)
                    eos = make_eos_unreachable(model_dir, BENCH_EOS)
                    report["meta"]["model"] = {
                        **asdict(plan.engine.model),
                        "params": params,
                        "params_m": params / 1e6,
                        "eos_token_id": eos,
                    }
                    throughput(args, plan, place, procs, redis_url, model_dir, report)
                if "connections" in parts:
                    connections(args, plan, place, procs, redis_url, report)
            except BaseException:
                for p in procs.procs:
                    if p.name != "redis":
                        print(f"--- {p.name} log tail\n{p.log_tail()}", file=sys.stderr)
                raise
            finally:
                procs.stop_all()
    finally:
        signal.alarm(0)

    report["meta"]["loadavg_end"] = loadavg()
    report["meta"]["wall_s"] = round(time.perf_counter() - started, 1)
    report["summary_lines"] = summary_lines(report)
    print_report(report)
    print(f"  (wall time {report['meta']['wall_s']} s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
