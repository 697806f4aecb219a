#!/usr/bin/env python
"""Spool batch benchmark: one batch of the Batches API against the engine alone, and the time to
first token of interactive requests while it runs against on an idle service.

One run, on a private ``redis-server`` and a ``spool worker`` and API this script starts and stops,
with engine_bench's random Llama (``--model``; EOS unreachable, so every line generates ``--max-tokens``):

throughput  ``--lines`` completion lines (random word prompts, greedy) as one batch (upload,
            create, poll until completed: validation, feeding and the results files included),
            against the same prompts through an ``Engine`` in this process with the same
            max_batch_size, kept full (twice its batch size in it at a time). Ratio: batch tok/s over engine tok/s (target >= 0.9).
ttft        ``--probes`` streamed ``/v1/completions`` requests, one after the other, on the idle
            service, then as many while each batch runs (``--rounds``, alternating with the
            engine alone, medians reported): p50 of each (target: during <= 1.5x idle).

    .venv/bin/python bench/batch_bench.py                         # 1,000 lines of 16 tokens
    .venv/bin/python bench/batch_bench.py --lines 200 --probes 5 --rounds 2  # a short run
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from measure import loadavg
from workload import FULL, QUICK, build_model, quiet_libraries

from common.schemas.requests import JobRequest
from spool_cli.procs import spool_argv, spool_env, start, start_api, start_redis, stop_all, wait_until
from workers.engine import Engine, EngineConfig
from workers.engine.tiny import make_eos_unreachable
from workers.job import sampling_params

TARGET_RATIO = 0.9
TARGET_TTFT = 1.5
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "old",
         "owls", "sing", "of", "rain", "and", "light"]  # fmt: skip


def prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24))) for _ in range(n)]


def engine_tok_s(engine: Engine, texts: list[str], max_tokens: int, batch: int) -> float:
    """The engine alone, kept full: ``2 * batch`` requests in it at a time, the next added as
    one ends (as the worker's task threads feed it; all at once, a queue of hundreds of waiting
    requests slows every step: see docs/benchmarks.md)."""
    params = sampling_params(
        JobRequest.model_validate({"prompt": "x", "max_tokens": max_tokens, "temperature": 0})
    )
    pending = list(enumerate(texts))[::-1]
    t0, tokens, inside = time.perf_counter(), 0, 0
    while pending or engine.has_unfinished():
        while pending and inside < 2 * batch:
            i, text = pending.pop()
            engine.add_request(f"bench-{t0}-{i}", text, params)
            inside += 1
        for delta in engine.step():
            tokens += len(delta.token_ids)
            inside -= bool(delta.finished)
    return tokens / (time.perf_counter() - t0)


def ttft_s(client: httpx.Client, prompt: str) -> float:
    return probe(client, prompt)[0]


def probe(client: httpx.Client, prompt: str) -> tuple[float, float]:
    """Seconds to the first chunk with text, and of those, from the job's creation to a worker
    taking it (its ``started_at``): the queue's part; the rest is the API's and the engine's."""
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    start = time.perf_counter()
    first, job_id = None, ""
    with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():  # read to the end: the stream closes after [DONE]
            if first is None and line.startswith("data: {"):
                chunk = json.loads(line[6:])
                job_id = chunk["id"].removeprefix("cmpl-")
                if chunk["choices"][0]["text"]:
                    first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("a probe got no token")
    job = client.get(f"/v1/jobs/{job_id}").json()
    return first, job["started_at"] - job["created_at"]


def run_batch(
    client: httpx.Client, texts: list[str], max_tokens: int, probes: int
) -> tuple[float, dict[str, Any], list[tuple[float, float]]]:
    """Seconds from the upload to the batch's end, the batch, and the probes sent during it
    (TTFT, queued: see ``probe``)."""
    lines = "".join(
        json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": t, "max_tokens": max_tokens, "temperature": 0}}) + "\n"
        for i, t in enumerate(texts)
    )  # fmt: skip
    t0 = time.perf_counter()
    file_id = client.post(
        "/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", lines.encode())}
    ).json()["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}
    batch = client.post("/v1/batches", json=body).json()
    during: list[tuple[float, float]] = []
    while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
        counts = batch["request_counts"]
        # Probes while lines wait in the queue: the first tenth of the batch is the ramp.
        if len(during) < probes and counts["total"] and counts["completed"] > counts["total"] // 10:
            during.append(probe(client, "probe " + texts[len(during)]))
        else:
            time.sleep(0.05)
        batch = client.get(f"/v1/batches/{batch['id']}").json()
    return time.perf_counter() - t0, batch, during


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lines", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--batch-size", type=int, default=32, help="SPOOL_MAX_BATCH_SIZE of the worker and the engine"
    )
    p.add_argument("--window", type=int, default=256, help="SPOOL_BATCH_WINDOW")
    p.add_argument("--probes", type=int, default=10, help="interactive requests, idle and during each batch")
    p.add_argument(
        "--rounds", type=int, default=3, help="engine and batch runs, alternating (medians reported)"
    )
    p.add_argument("--model", choices=["full", "quick"], default="full",
                   help="workload.py's random Llama: full (~58M parameters) or quick (tiny, steps of about a ms)")  # fmt: skip
    p.add_argument(
        "--threads", type=int, default=1,
        help="torch threads of the engine alone and of the worker (SPOOL_TORCH_THREADS); the same on both sides",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    quiet_libraries()
    texts = prompts(args.lines, args.seed)
    engine_runs: list[float] = []
    batch_runs: list[float] = []
    during: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory(prefix="spool-batch-bench-") as tmp:
        work = Path(tmp)
        model = work / "model"
        build_model(model, (FULL if args.model == "full" else QUICK).model, args.seed)
        make_eos_unreachable(model)
        torch.set_num_threads(args.threads)
        engine = Engine(EngineConfig(model=str(model), max_batch_size=args.batch_size), seed=0)
        engine_tok_s(engine, texts[: args.batch_size], args.max_tokens, args.batch_size)  # warm-up
        procs = []
        try:
            redis, redis_url = start_redis(log_dir=work, data_dir=work)
            procs.append(redis)
            # compile=False: the eager forward, as the engine alone it is compared with
            env = spool_env(redis_url, "bench-batch", model=model, max_batch_size=args.batch_size,
                            batch_window=args.window, heartbeat_s=0.5, torch_threads=args.threads,
                            compile=False)  # fmt: skip
            worker = start("worker", [*spool_argv(), "worker"], env=env, log_dir=work)
            procs.append(worker)
            api, url = start_api("api", env, log_dir=work)
            procs.append(api)
            with httpx.Client(base_url=url, timeout=120) as client:
                wait_until(lambda: client.get("/readyz").status_code == 200, "a worker", 180, [worker, api])
                ttft_s(client, "warm up")
                idle = [probe(client, "probe " + t) for t in texts[: args.probes]]
                # Alternating, so that the other load of a shared machine falls on both sides alike.
                for _ in range(args.rounds):
                    engine_runs.append(engine_tok_s(engine, texts, args.max_tokens, args.batch_size))
                    seconds, batch, probes = run_batch(client, texts, args.max_tokens, args.probes)
                    if batch["status"] != "completed" or batch["request_counts"]["completed"] != args.lines:
                        print(f"the batch did not complete: {batch}", file=sys.stderr)
                        return 1
                    batch_runs.append(args.lines * args.max_tokens / seconds)
                    during += probes
        finally:
            stop_all(procs)
    engine_median, batch_median = statistics.median(engine_runs), statistics.median(batch_runs)
    report: dict[str, Any] = {
        "lines": args.lines,
        "max_tokens": args.max_tokens,
        "batch_size": args.batch_size,
        "window": args.window,
        "model": args.model,
        "threads": args.threads,
        "engine_tok_s": engine_runs,
        "batch_tok_s": batch_runs,
        "ratio": batch_median / engine_median,
        "ttft_idle_p50_ms": p50_ms(idle, 0),
        "ttft_during_p50_ms": p50_ms(during, 0),
        "queued_idle_p50_ms": p50_ms(idle, 1),
        "queued_during_p50_ms": p50_ms(during, 1),
        "loadavg": loadavg(),
    }
    print(f"batch of {args.lines} lines x {args.max_tokens} tokens, {args.model} model, "
          f"max_batch_size {args.batch_size}, window {args.window}, {args.rounds} rounds, {args.threads} torch thread(s) each side")  # fmt: skip
    print(
        f"  engine alone       {engine_median:8.1f} tok/s (runs: {', '.join(f'{x:.0f}' for x in engine_runs)})"
    )
    print(f"  batch (end to end) {batch_median:8.1f} tok/s (runs: {', '.join(f'{x:.0f}' for x in batch_runs)})   "
          f"ratio {report['ratio']:.2f} (target >= {TARGET_RATIO})")  # fmt: skip
    if during:
        factor = report["ttft_during_p50_ms"] / report["ttft_idle_p50_ms"]
        print(f"  TTFT p50 idle {report['ttft_idle_p50_ms']:.0f} ms, during the batch {report['ttft_during_p50_ms']:.0f} ms: "
              f"{factor:.2f}x (target <= {TARGET_TTFT}x; {len(during)} probes)")  # fmt: skip
        print(f"    of which queued (created to taken by the worker) p50: idle {report['queued_idle_p50_ms']:.0f} ms, "
              f"during {report['queued_during_p50_ms']:.0f} ms")  # fmt: skip
    print(f"  load average {report['loadavg']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def p50_ms(probes: list[tuple[float, float]], field: int) -> float | None:
    return statistics.median(p[field] for p in probes) * 1e3 if probes else None


if __name__ == "__main__":
    sys.exit(main())
