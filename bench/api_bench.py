"""The API's own CPU per request, for one checkout or several side by side.

For each ``--tree`` (default: this checkout) the script starts an API process of that checkout
(``python -m uvicorn api.main:app``, run from the tree) under a key prefix of its own, on a
private redis-server, with no worker: the script plays the worker's part through the job store
(a heartbeat, taking jobs, appending their events as a step's writes do). It measures the CPU
time of the API process (``/proc``, all threads) for:

- ``POST /v1/jobs``, one at a time, and in bursts of 32 at once (with the bursts' p50 latency);
- opening ``GET /v1/jobs/{id}/events`` up to its first bytes: a finished job (8 token events
  and ``done``, replayed) and a running job (one event so far, then live);
- events relayed to streams open on that process: 32 jobs' token events, a step's writes at a
  time, paced as an engine's steps (``--step-ms``), each job streamed by one client: as the job's
  own events, as chat completion chunks (``?format=openai`` of a chat job), and as the Responses
  API's events (``GET /v1/responses/{id}?stream=true``; a tree without it gets no figure);
- events of jobs that nobody streams on that process (another replica's, or fire-and-poll
  jobs): the same writes.

The trees take turns, round after round, so drift in the machine's speed hits them alike; the
figures are medians over the rounds, and each tree's ratio to the first is printed. To compare
a change with what it replaces: ``git worktree add /tmp/before HEAD~1`` and
``--tree /tmp/before --tree .``. Speed is never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from measure import cpu_seconds, log

from common.schemas.events import DoneEvent, LogEntry
from common.schemas.requests import JobRequest
from common.schemas.views import JobStatus, Usage, WorkerHeartbeat
from common.settings import Settings
from common.store import Append, Appended, AsyncJobStore, Final, SyncJobStore, token_entry
from spool_cli import procs as harness

REPO_ROOT = Path(__file__).resolve().parent.parent

BURST = 32
STEP_JOBS = 32  # jobs per step write in the events parts
MAX_QUEUED = 10**7  # the submitted jobs stay queued (no worker): no backpressure here


class Target:
    """One tree's API process and a store on its prefix."""

    def __init__(
        self, procs: list[harness.Proc], log_dir: Path, redis_url: str, tree: Path, index: int
    ) -> None:
        prefix = f"apibench{index}"
        self.tree = tree
        env = harness.spool_env(redis_url, prefix, max_queued_jobs=MAX_QUEUED)
        self.proc, self.url = harness.start_api(f"api{index}", env, log_dir=log_dir, tree=tree)
        procs.append(self.proc)
        settings = Settings.model_validate(
            {
                "redis_url": redis_url,
                "redis_prefix": prefix,
                "max_queued_jobs": MAX_QUEUED,
                "heartbeat_ttl_s": 3600,
            }
        )
        self.store = SyncJobStore.from_settings(settings)
        # A worker's heartbeat (for the run's length), so that submits find a served model as in service.
        self.store.beat(WorkerHeartbeat(name="bench", ts=time.time(), engine={}, model="bench"))

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def running_job(self, tokens: int, shape: str = "spool") -> tuple[str, int]:
        """A job taken as a worker takes it, with ``tokens`` token events: (id, attempt); a chat
        job for the ``chat`` and ``responses`` shapes, with a response's record for the latter."""
        job_id = asyncio.run(self._create_job(shape))
        attempt = self.store.take_job(job_id, "bench", "bench").attempt
        if tokens:
            entries = [token_entry(i + 1, i, " word", [7]) for i in range(tokens)]
            assert self.store.append_batch([Append(job_id, attempt, entries, 1, tokens)]) == [
                Appended.WRITTEN
            ]
        return job_id, attempt

    async def _create_job(self, shape: str) -> str:
        """A queued job, created as the API creates one (without its Celery message)."""
        store = AsyncJobStore.from_settings(self.store.settings)
        prompt = (
            {"prompt": "hello"} if shape == "spool" else {"messages": [{"role": "user", "content": "hello"}]}
        )
        try:
            job = await store.create_job(JobRequest.model_validate({**prompt, "max_tokens": 4096}))
            if shape == "responses":
                record = {"model": "bench", "created_at": job.created_at, "input": [], "background": True}
                await store.put_response(job.id, json.dumps(record))
            return job.id
        finally:
            await store.close()

    def finish(self, job_id: str, attempt: int, tokens: int) -> None:
        """Its ``done`` event, as the step that generated its last token writes it."""
        usage = Usage.of(1, tokens)
        done = LogEntry.done(
            tokens + 1, DoneEvent(status=JobStatus.SUCCEEDED, finish_reason="length", usage=usage)
        )
        final = Final(JobStatus.SUCCEEDED, "length")
        assert self.store.append_batch([Append(job_id, attempt, [done], 1, tokens, final)]) == [
            Appended.WRITTEN
        ]


def cpu_per_call(target: Target, n: int, call: Callable[[], Any]) -> float:
    """CPU ms of the API process per ``call``, over ``n`` calls one after another."""
    before = target.cpu()
    for _ in range(n):
        call()
    return 1e3 * (target.cpu() - before) / n


def posts_alone(target: Target, client: httpx.Client, n: int) -> dict[str, float]:
    def post() -> None:
        client.post(
            f"{target.url}/v1/jobs", json={"prompt": "hello there", "max_tokens": 4}
        ).raise_for_status()

    return {"post_alone_cpu_ms": cpu_per_call(target, n, post)}


def posts_in_bursts(target: Target, bursts: int) -> dict[str, float]:
    async def run() -> list[float]:
        latencies: list[float] = []
        async with httpx.AsyncClient(timeout=60) as client:

            async def post(t0: float) -> float:
                r = await client.post(
                    f"{target.url}/v1/jobs", json={"prompt": "hello there", "max_tokens": 4}
                )
                r.raise_for_status()
                return time.perf_counter() - t0

            for _ in range(bursts):
                t0 = time.perf_counter()
                latencies += await asyncio.gather(*(post(t0) for _ in range(BURST)))
        return latencies

    before = target.cpu()
    latencies = asyncio.run(run())
    return {
        "post_burst_cpu_ms": 1e3 * (target.cpu() - before) / (bursts * BURST),
        "post_burst_p50_ms": 1e3 * statistics.median(latencies),
    }


def stream_opens(target: Target, client: httpx.Client, n: int) -> dict[str, float]:
    def first_bytes(job_id: str) -> Callable[[], None]:
        def call() -> None:
            with client.stream("GET", f"{target.url}/v1/jobs/{job_id}/events") as r:
                r.raise_for_status()
                next(r.iter_raw())

        return call

    finished, attempt = target.running_job(8)
    target.finish(finished, attempt, 8)
    live, _ = target.running_job(1)
    return {
        "open_finished_cpu_ms": cpu_per_call(target, n, first_bytes(finished)),
        "open_live_cpu_ms": cpu_per_call(target, n, first_bytes(live)),
    }


def write_step(target: Target, jobs: list[tuple[str, int]], step: int) -> None:
    """One engine step's writes: a token event for each of the running ``jobs`` (id, attempt)."""
    appends = [
        Append(job_id, attempt, [token_entry(step + 1, step, " word", [7])], 1, step + 1)
        for job_id, attempt in jobs
    ]
    target.store.append_batch(appends)


# Per stream shape: the path of a job's stream, and what each of its token events carries once.
SHAPES = {
    "spool": ("/v1/jobs/{}/events", b"event: token"),
    "chat": ("/v1/jobs/{}/events?format=openai", b'"object":"chat.completion.chunk"'),
    "responses": ("/v1/responses/resp_{}?stream=true", b"event: response.output_text.delta"),
}
FIGURES = {"spool": "streamed_cpu_us_per_event", "chat": "streamed_chat_cpu_us_per_event"}
FIGURES["responses"] = "streamed_responses_cpu_us_per_event"


def events_streamed(target: Target, steps: int, step_s: float, shape: str = "spool") -> dict[str, float]:
    """CPU per event relayed: STEP_JOBS streams open, ``steps`` step writes ``step_s`` apart,
    then each job's ``done``; the figure ends when every stream has been closed by the server."""
    if shape == "responses" and not (target.tree / "api" / "routes" / "responses.py").exists():
        return {}
    jobs = [target.running_job(0, shape) for _ in range(STEP_JOBS)]
    host, port = target.url.removeprefix("http://").split(":")
    path, per_token = SHAPES[shape]

    async def open_stream(job_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"GET {path.format(job_id)} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        await reader.readuntil(b"\r\n\r\n")  # the response's head: the stream is open
        return reader, writer

    async def run() -> tuple[float, list[bytes]]:
        streams = await asyncio.gather(*(open_stream(job_id) for job_id, _ in jobs))
        reads = [asyncio.ensure_future(reader.read()) for reader, _ in streams]  # to the server's close

        def write() -> None:
            next_step = time.perf_counter()
            for step in range(steps):
                write_step(target, jobs, step)
                next_step += step_s
                time.sleep(max(0.0, next_step - time.perf_counter()))
            for job_id, attempt in jobs:
                target.finish(job_id, attempt, steps)

        before = target.cpu()
        await asyncio.to_thread(write)
        bodies = await asyncio.gather(*reads)
        cpu = target.cpu() - before
        for _, writer in streams:
            writer.close()
        return cpu, bodies

    cpu, bodies = asyncio.run(run())
    for body in bodies:  # every stream got every token event (the chat chunks: and the final one)
        assert body.count(per_token) == steps + (shape == "chat"), body[-200:]
    return {FIGURES[shape]: 1e6 * cpu / (steps * STEP_JOBS)}


def events_not_streamed(target: Target, steps: int) -> dict[str, float]:
    jobs = [target.running_job(0) for _ in range(STEP_JOBS)]
    before = target.cpu()
    for step in range(steps):
        write_step(target, jobs, step)
    time.sleep(0.5)  # let the API drain what it receives (an idle process costs ~nothing meanwhile)
    return {"not_streamed_cpu_us_per_event": 1e6 * (target.cpu() - before) / (steps * STEP_JOBS)}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--tree", type=Path, action="append", help="a checkout to measure (repeatable; default: this one)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=200, help="POSTs and stream opens per round")
    parser.add_argument("--bursts", type=int, default=8, help=f"bursts of {BURST} POSTs per round")
    parser.add_argument("--steps", type=int, default=200, help=f"steps of {STEP_JOBS} events per round")
    parser.add_argument(
        "--step-ms", type=float, default=10.0, help="time between step writes while streams are open"
    )
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args()
    trees = [t.resolve() for t in (args.tree or [REPO_ROOT])]

    with tempfile.TemporaryDirectory(prefix="spool-api-bench-") as tmp:
        procs: list[harness.Proc] = []
        try:
            redis, redis_url = harness.start_redis(data_dir=Path(tmp), log_dir=Path(tmp))
            procs.append(redis)
            targets = [Target(procs, Path(tmp), redis_url, tree, i) for i, tree in enumerate(trees)]
            rounds: list[list[dict[str, float]]] = [[] for _ in targets]
            with httpx.Client(timeout=60) as client:
                for target in targets:  # warm-up: every path once
                    posts_alone(target, client, 20)
                    posts_in_bursts(target, 1)
                    stream_opens(target, client, 20)
                    for shape in SHAPES:
                        events_streamed(target, 20, args.step_ms / 1e3, shape)
                    events_not_streamed(target, 20)
                for r in range(args.rounds):
                    for i, target in enumerate(targets):
                        figures = {
                            **posts_alone(target, client, args.requests),
                            **posts_in_bursts(target, args.bursts),
                            **stream_opens(target, client, args.requests),
                            **{
                                k: v
                                for shape in SHAPES
                                for k, v in events_streamed(
                                    target, args.steps, args.step_ms / 1e3, shape
                                ).items()
                            },
                            **events_not_streamed(target, args.steps),
                        }
                        rounds[i].append(figures)
                        log(
                            f"round {r + 1}/{args.rounds} {target.tree}: "
                            + json.dumps({k: round(v, 2) for k, v in figures.items()})
                        )
        finally:
            harness.stop_all(procs)

    medians = [
        {k: statistics.median(f[k] for f in tree_rounds) for k in tree_rounds[0]} for tree_rounds in rounds
    ]
    for m in medians:  # (a tree without the Responses API has no figure of it)
        m.setdefault(FIGURES["responses"], float("nan"))
    print(f"API CPU per request, medians of {args.rounds} rounds (the trees alternating)")
    names = list(medians[0])
    print(f"{'figure':<32}" + "".join(f"{str(t)[-28:]:>30}" for t in trees))
    for name in names:
        cells = []
        for m in medians:
            ratio = f" ({m[name] / medians[0][name]:.2f}x)" if len(trees) > 1 and medians[0][name] else ""
            cells.append(f"{m[name]:.2f}{ratio}")
        print(f"{name:<32}" + "".join(f"{c:>30}" for c in cells))
    if args.json:
        args.json.write_text(
            json.dumps({"trees": [str(t) for t in trees], "rounds": rounds, "medians": medians}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
