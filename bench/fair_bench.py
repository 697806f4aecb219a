#!/usr/bin/env python
"""Fair shares between tenants in the engine: the Virtual Token Counter against first come, first
served, one run, side by side (docs/benchmarks.md, "Fair shares").

The engine alone (no Redis, no HTTP), on the tiny Llama (built in a temp dir), EOS ignored:

backlogged  two tenants submit at once: "long" N requests of 32..64 prompt tokens and 32..64 new
            ones, then "short" N requests of 8..16 and 8..16. While both wait: the weighted
            service (prompt + 2 x generated tokens) each gets per window of W steps, the largest
            gap between them over those windows, and Jain's fairness index over the period
            ((a + b)^2 / (2 (a^2 + b^2)), 1 is an even split).
flood       "flood" submits F short requests at once; "trickle" sends T requests one after the
            other (each when the last ended): trickle's time to first token p50 and p99 against
            its figure on an idle engine.
throughput  generated tokens per second of the backlogged run, fairness on / off: the median of
            --repeats runs each, FCFS and fair alternating, so that a change in the machine's load
            falls on both; also per CPU second of this process and per engine step, which other
            processes on a shared machine bend less than the wall clock.

Two models on one Redis (every job on its own model) is a test, not a figure: tests/test_models.py.

    .venv/bin/python bench/fair_bench.py                    # N=200, F=2000, T=40
    nice -n 5 .venv/bin/python bench/fair_bench.py --requests 100 --flood 500 --trickle 20 --repeats 2
    .venv/bin/python bench/fair_bench.py --parts flood      # one part: backlogged or flood
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from workers.engine import Engine, EngineConfig, SamplingParams, TokenWeights
from workers.engine.tiny import build_tiny_model

WEIGHTS = TokenWeights()  # prompt 1, output 2: the service counted
SLOTS = 8


def engine(model: Path, fair: bool) -> Engine:
    config = EngineConfig(
        model=str(model),
        max_batch_size=SLOTS,
        enable_prefix_caching=False,
        fair_share=WEIGHTS if fair else None,
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


def trickle_ttft(model: Path, fair: bool, flood: int, trickle: int) -> list[float]:
    """The trickle tenant's TTFTs (s), one request at a time, beside ``flood`` short requests."""
    rng = random.Random(1)
    e = engine(model, fair)
    for i in range(flood):
        e.add_request(f"flood-{i}", prompt(rng, 8), params("flood", 8))
    ttfts = []
    for i in range(trickle):
        rid, sent, first = f"trickle-{i}", time.perf_counter(), None
        e.add_request(rid, prompt(rng, 16), params("trickle", 16))
        done = False
        while not done:
            for d in e.step():
                if d.request_id == rid:
                    if first is None and d.token_ids:
                        first = time.perf_counter() - sent
                    done = done or d.finish_reason is not None
        assert first is not None
        ttfts.append(first)
    return ttfts


def pct(xs: list[float], q: float) -> float:
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
    ap.add_argument(
        "--parts", default="backlogged,flood", help="which parts to run, comma-separated (default: both)"
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "tiny", "llama")
        engine(model, True).generate([[1, 2, 3]], params("", 4))  # warm-up (first forwards)
        parts = set(args.parts.split(","))
        if "backlogged" in parts:
            run_backlogged(model, args)
        if "flood" in parts:
            run_flood(model, args)


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
    idle = trickle_ttft(model, True, 0, args.trickle)
    print(f"flood: {args.flood} short requests; trickle: {args.trickle} one by one")
    print(f"  idle: trickle TTFT p50 {pct(idle, 50) * 1e3:.1f} ms, p99 {pct(idle, 99) * 1e3:.1f} ms")
    for fair in (False, True):
        t = trickle_ttft(model, fair, args.flood, args.trickle)
        print(
            f"  {'fair' if fair else 'FCFS'}: trickle TTFT p50 {pct(t, 50) * 1e3:.1f} ms "
            f"({pct(t, 50) / pct(idle, 50):.2f}x idle), p99 {pct(t, 99) * 1e3:.1f} ms "
            f"({pct(t, 99) / pct(idle, 99):.2f}x idle; target within 1.5x fair)"
        )


if __name__ == "__main__":
    main()
