"""What the benchmarks read of the machine (/proc, the load average) and how they print it."""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def verdict(ok: bool | None) -> str:
    return "" if ok is None else ("  [meets target]" if ok else "  [BELOW target]")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (q in [0, 100])."""
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


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
    return {
        **{name: sum(map(cpu_seconds, group)) for name, group in pids.items()},
        "clients": time.process_time(),
    }


def raise_fd_limit(needed: int) -> int:
    """Raise this process's soft open-files limit (children inherit it); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return int(soft)
