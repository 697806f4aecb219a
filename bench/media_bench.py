#!/usr/bin/env python
"""Spool media benchmark: image parts through API + Redis + a media worker, against the pipeline.

One run, on a private ``redis-server`` and processes this script starts and stops:

images  ``--images`` images (``--size``, ``--steps``, one seed each) made by the tiny random
        Stable Diffusion pipeline (``spool tiny-image-model``) called directly in this process
        (``ImagePipeline.generate``, one image after another), and through the stack: one
        ``spool worker --kind media`` and one API, every image a job of one image part, all
        POSTed at once, done when the last job ended. The two alternate for ``--rounds`` rounds;
        the medians of images/s are reported, and their ratio (target >= 0.9).
ttft    Time to first token of a text part (``--text-jobs`` jobs, one at a time, on a text worker
        running the tiny model), in a text-only job and in a job with a text part and an image
        part (target: at most +10%), from the POST to the first ``token`` event of the stream,
        and where it went (api / queue / engine, from the job's own timestamps: ``first_token_s``).
        The jobs with an image part alternate between the media worker at the niceness of the
        other processes (the script's own, which they inherit: under ``nice -n 5`` it is 5) and
        ``--nice`` above it (``SPOOL_IMAGE_NICE``, 10 as ``spool up`` sets it; the script renices
        its threads, which needs root to go back); every job starts with the media worker idle
        and ends before the next starts. A fourth job per iteration has its image part take its
        prompt from the text part (``prompt_from``): the same two parts, POST and create script,
        but the image runs only after the text part ended, so what the other image jobs add
        beyond it is what the image's work running beside the text part's first forward costs.
        Each iteration runs the four in turn, starting one further along than the one before,
        so each takes every position equally often.

Both workers and the direct pipeline run the torch threads ``spool up`` gives its workers
(``SPOOL_TORCH_THREADS``: the CPUs minus one; this process's ``torch.set_num_threads``).

    .venv/bin/python bench/media_bench.py                 # a short run (about a minute on 2 cores)
    .venv/bin/python bench/media_bench.py --images 16 --rounds 3 --json /tmp/media.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import httpx
import redis
import torch
from measure import loadavg, log

from common.keys import Keys
from spool_cli import procs as harness
from spool_cli.procs import spool_argv, spool_env, wait_until
from spool_cli.up import MEDIA_NICE, worker_torch_threads
from workers.engine.tiny import build_tiny_model
from workers.media.pipeline import ImagePipeline, ImageSpec
from workers.media.tiny import build_tiny_image_model

PREFIX = "bench-media"


def direct_images_per_s(pipe: ImagePipeline, n: int, size: int, steps: int) -> float:
    t0 = time.perf_counter()
    for seed in range(n):
        pipe.generate(ImageSpec("a lighthouse at dusk", size, size, steps, seed), lambda s, t, p: True)
    return n / (time.perf_counter() - t0)


async def stack_images_per_s(url: str, n: int, size: int, steps: int) -> float:
    part = {"type": "image", "prompt": "a lighthouse at dusk", "size": f"{size}x{size}", "steps": steps}
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        t0 = time.perf_counter()
        posts = [c.post("/v1/jobs", json={"parts": [{**part, "seed": s}]}) for s in range(n)]
        ids = [r.json()["id"] for r in await asyncio.gather(*posts)]
        # Done when the last one ended: each job's event stream read to its end in turn (a poll
        # of every job would take CPU from the media worker).
        for job_id in ids:
            async with c.stream("GET", f"/v1/jobs/{job_id}/events") as r:
                async for _ in r.aiter_lines():
                    pass
        elapsed = time.perf_counter() - t0
        for job_id in ids:
            assert (await c.get(f"/v1/jobs/{job_id}")).json()["status"] == "succeeded"
    return n / elapsed


PHASES = ("api", "queue", "engine")


def first_token_s(client: httpx.Client, body: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """The time to the first token, and where it went (``PHASES``), from the job's own timestamps
    (read after the stream, untimed): ``api`` = the POST's start to the job's ``created_at``
    (HTTP, validation, the checks; the API stamps it just before its create script), ``queue`` =
    ``created_at`` to the text part's ``started_at`` (the create script, its message delivered,
    the part taken), ``engine`` = ``started_at`` to the first token at this client (the engine
    thread, prefill, the step's write, the relay)."""
    wall0, t0 = time.time(), time.perf_counter()
    first = wall = None
    with client.stream("POST", "/v1/jobs", json={**body, "stream": True}) as r:
        job_id = r.headers["Location"].rsplit("/", 1)[1]
        for line in r.iter_lines():  # to its end, so the job has ended when it is read
            if first is None and line == "event: token":
                first, wall = time.perf_counter() - t0, time.time()
    if first is None or wall is None:
        raise RuntimeError("the stream ended without a token")
    job = client.get(f"/v1/jobs/{job_id}").json()
    started = job["parts"][0]["started_at"]
    phases = {
        "api": job["created_at"] - wall0,
        "queue": started - job["created_at"],
        "engine": wall - started,
    }
    return first, phases


def renice(pid: int, nice: int) -> None:
    """Every thread of process ``pid`` at ``nice`` (Linux keeps a niceness per thread; lowering
    it again needs CAP_SYS_NICE)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)


def ttft(url: str, jobs: int, size: int, steps: int, media_pid: int, nice: int) -> dict[str, float]:
    text = {"type": "text", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    image = {"type": "image", "prompt": "a lighthouse", "size": f"{size}x{size}", "steps": steps}
    runs: dict[str, list[float]] = {
        "text": [],
        "text+image": [],
        "text+image niced": [],
        "text+image after": [],
    }
    base = os.getpriority(os.PRIO_PROCESS, 0)  # the niceness the workers started with
    phases: dict[str, list[dict[str, float]]] = {k: [] for k in runs}

    def timed(kind: str, body: dict[str, Any]) -> None:
        first, where = first_token_s(c, body)
        runs[kind].append(first)
        phases[kind].append(where)

    with httpx.Client(base_url=url, timeout=120) as c:

        def idle() -> bool:
            workers = c.get("/readyz").json()["workers"]
            return not any(w["engine"].get("running") for w in workers if w.get("kind") == "media")

        for i in range(jobs):  # alternated, so a slow moment of a shared machine hits every variant
            variants = [
                ("text", {"parts": [text]}, base),
                ("text+image", {"parts": [text, {**image, "seed": i}]}, base),
                ("text+image after", {"parts": [text, {**image, "prompt": None, "prompt_from": 0}]}, base),
                # SPOOL_IMAGE_NICE, as `spool up` sets it
                ("text+image niced", {"parts": [text, {**image, "seed": i}]}, base + nice),
            ]
            for kind, body, niceness in variants[i % 4 :] + variants[: i % 4]:  # each in every position
                renice(media_pid, niceness)
                timed(kind, body)
                wait_until(idle, "the media worker idle", 120)
    medians = {k: statistics.median(v) for k, v in runs.items()}
    for k, ps in phases.items():
        for phase in PHASES:
            medians[f"{k} {phase}"] = statistics.median(p[phase] for p in ps)
    # Paired: each job with an image part against the text-only job of its own iteration, so a
    # slow minute of a shared machine weighs on both sides of a ratio.
    for k in ("text+image", "text+image niced", "text+image after"):
        medians[f"{k} paired"] = statistics.median(b / a for a, b in zip(runs["text"], runs[k], strict=True))
    return medians


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--text-jobs", type=int, default=10)
    ap.add_argument("--nice", type=int, default=MEDIA_NICE, help="the niced media worker's niceness")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    threads = int(worker_torch_threads({}))  # the CPUs minus one, as `spool up` sets
    torch.set_num_threads(threads)  # the direct pipeline's, as the media worker's
    work = Path(tempfile.mkdtemp(prefix="spool-media-bench-"))
    image_model = build_tiny_image_model(work / "tiny-sd")
    text_model = build_tiny_model(work / "tiny-llama", "llama")
    procs: list[harness.Proc] = []
    try:
        redis_proc, redis_url = harness.start_redis(data_dir=work, log_dir=work)
        procs.append(redis_proc)
        r = redis.Redis.from_url(redis_url)
        keys = Keys(PREFIX)
        common = {
            "heartbeat_s": 0.5,
            "max_image_steps": 1000,
            "compile": False,
        }  # the figures' eager text worker
        workers = {**common, "torch_threads": threads}  # as `spool up` gives both workers
        text_env = spool_env(redis_url, PREFIX, model=text_model, worker_name="text", **workers)
        media_env = spool_env(redis_url, PREFIX, image_model=image_model, worker_name="media", **workers)
        procs.append(harness.start("text", [*spool_argv(), "worker"], env=text_env, log_dir=work))
        media = [*spool_argv(), "worker", "--kind", "media"]
        media_proc = harness.start("media", media, env=media_env, log_dir=work)
        procs.append(media_proc)
        for name in ("text", "media"):
            wait_until(lambda n=name: bool(r.exists(keys.worker(n))), f"{name} heartbeat", 180, procs)
        api, url = harness.start_api("api", spool_env(redis_url, PREFIX, **common), log_dir=work)
        procs.append(api)
        log(f"load average before: {loadavg()}")
        pipe = ImagePipeline(str(image_model))
        direct_images_per_s(pipe, 1, args.size, args.steps)  # warm-up
        asyncio.run(stack_images_per_s(url, 1, args.size, args.steps))
        direct, stack = [], []
        for _ in range(args.rounds):
            direct.append(direct_images_per_s(pipe, args.images, args.size, args.steps))
            stack.append(asyncio.run(stack_images_per_s(url, args.images, args.size, args.steps)))
        first = ttft(url, args.text_jobs, args.size, args.steps, media_proc.pid, args.nice)
        log(f"load average after: {loadavg()}")
    finally:
        harness.stop_all(reversed(procs))
    result = {
        "images": args.images,
        "size": args.size,
        "steps": args.steps,
        "rounds": args.rounds,
        "direct_images_per_s": statistics.median(direct),
        "stack_images_per_s": statistics.median(stack),
        "stack_over_direct": statistics.median(stack) / statistics.median(direct),
        "ttft_text_only_ms": first["text"] * 1000,
        "ttft_text_with_image_ms": first["text+image"] * 1000,
        "ttft_added_pct": (first["text+image"] / first["text"] - 1) * 100,
        "nice": args.nice,
        "ttft_text_with_image_niced_ms": first["text+image niced"] * 1000,
        "ttft_added_niced_pct": (first["text+image niced"] / first["text"] - 1) * 100,
        "ttft_added_paired_pct": (first["text+image paired"] - 1) * 100,
        "ttft_added_niced_paired_pct": (first["text+image niced paired"] - 1) * 100,
        "ttft_text_with_image_after_ms": first["text+image after"] * 1000,
        "ttft_added_after_pct": (first["text+image after"] / first["text"] - 1) * 100,
        "ttft_added_after_paired_pct": (first["text+image after paired"] - 1) * 100,
        "ttft_phases_ms": {
            k: {phase: first[f"{k} {phase}"] * 1000 for phase in PHASES}
            for k in ("text", "text+image", "text+image niced", "text+image after")
        },
    }
    print(
        f"images  {args.images} x {args.size}x{args.size}, {args.steps} steps, {args.rounds} rounds\n"
        f"        direct {result['direct_images_per_s']:.2f} img/s   stack {result['stack_images_per_s']:.2f} img/s"
        f"   stack/direct {result['stack_over_direct']:.2f} (target >= 0.9)\n"
        f"ttft    text-only {result['ttft_text_only_ms']:.1f} ms   with an image part "
        f"{result['ttft_text_with_image_ms']:.1f} ms   ({result['ttft_added_pct']:+.0f}%; target <= +10%; paired {result['ttft_added_paired_pct']:+.0f}%)\n"
        f"        with an image part, the media worker at nice +{args.nice} "
        f"{result['ttft_text_with_image_niced_ms']:.1f} ms   ({result['ttft_added_niced_pct']:+.0f}%; "
        f"paired {result['ttft_added_niced_paired_pct']:+.0f}%)\n"
        f"        with an image part that runs after the text (prompt_from) "
        f"{result['ttft_text_with_image_after_ms']:.1f} ms   ({result['ttft_added_after_pct']:+.0f}%; "
        f"paired {result['ttft_added_after_paired_pct']:+.0f}%)"
    )
    for k, ms in result["ttft_phases_ms"].items():
        print(f"        phases, {k}: " + " / ".join(f"{p} {v:.1f}" for p, v in ms.items()) + " ms")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
