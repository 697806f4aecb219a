#!/usr/bin/env python
"""Spool start-up benchmark: `spool up` on the default model, from its start to "spool: ready",
eager and compiled, cold and warm, alternating.

Each start is a fresh `spool up` (API, text, media and hook workers) on a private
``redis-server``; it is timed from the process's start to its ``spool: ready at`` line (a text
worker serves the model and /readyz answers), then stopped. Cold: empty compile caches (a new
directory as ``SPOOL_COMPILE_CACHE_DIR``, where the worker keeps its compiled forward, and as
``TORCHINDUCTOR_CACHE_DIR``, inductor's own); warm: the same directory again, as a restart finds
it. The text worker's own ``compiled the forward in X s`` line is reported beside it. A round is eager cold, compiled cold,
eager warm, compiled warm, in that order, so that a machine whose load changes (other jobs)
spreads over every mode; the medians over ``--rounds`` are printed, with the load average.

    .venv/bin/python bench/startup_bench.py               # 2 rounds
    .venv/bin/python bench/startup_bench.py --rounds 1 --modes compiled
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from measure import loadavg, log

from spool_cli.procs import spool_argv, spool_env, start, start_redis, stop_all, wait_until

READY = "spool: ready at"
COMPILED = re.compile(r"compiled the forward in ([\d.]+) s")


def one_start(
    redis_url: str, cache_dir: Path, compiled: bool, log_dir: Path, name: str, timeout: float
) -> tuple[float, float | None]:
    """Seconds from `spool up`'s start to its ready line, and the worker's compile seconds."""
    from spool_cli.procs import free_port

    env = spool_env(redis_url, f"startup-{name}", port=free_port(), compile=str(compiled).lower())
    env["SPOOL_COMPILE_CACHE_DIR"] = env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    started = time.perf_counter()
    up = start(name, [*spool_argv(), "up"], env=env, log_dir=log_dir)
    try:
        wait_until(lambda: READY in up.log_tail(), f"{name}: ready", timeout, [up])
        ready = time.perf_counter() - started
    finally:
        stop_all([up])
    found = COMPILED.findall(up.log_tail(10**7))
    return ready, float(found[-1]) if found else None


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", choices=["both", "eager", "compiled"], default="both")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one start may take")
    args = parser.parse_args()
    modes = [m for m in (False, True) if args.modes == "both" or args.modes == ("compiled" if m else "eager")]

    results: dict[str, list[float]] = {}
    compile_s: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="spool-startup-") as tmp:
        root = Path(tmp)
        redis, redis_url = start_redis(log_dir=root)
        try:
            for r in range(args.rounds):
                caches = {m: root / f"cache-{r}-{'compiled' if m else 'eager'}" for m in modes}
                for temperature in ("cold", "warm"):
                    for compiled in modes:
                        key = f"{'compiled' if compiled else 'eager'} {temperature}"
                        name = f"up-{r}-{key.replace(' ', '-')}"
                        before = loadavg()
                        ready, comp = one_start(
                            redis_url, caches[compiled], compiled, root, name, args.timeout
                        )
                        results.setdefault(key, []).append(ready)
                        if comp is not None:
                            compile_s.setdefault(key, []).append(comp)
                        log(
                            f"round {r + 1}: {key}: ready in {ready:.1f} s"
                            + (f" (compiled the forward in {comp:.1f} s)" if comp is not None else "")
                            + f", load average {before}"
                        )
        finally:
            stop_all([redis])

    print(
        f"spool up to ready, default model, medians of {args.rounds} round(s); load average now {loadavg()}"
    )
    for key, values in results.items():
        comp = compile_s.get(key)
        extra = f"   compile {statistics.median(comp):6.1f} s" if comp else ""
        print(
            f"  {key:15s} {statistics.median(values):6.1f} s  (each: {', '.join(f'{v:.1f}' for v in values)}){extra}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
