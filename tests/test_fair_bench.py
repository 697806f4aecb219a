"""bench/fair_bench.py runs end to end (a smoke run at tiny sizes: its figures are printed, never
asserted; the models part's routing is, and that it leaves no key of its prefix behind)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from procs import REDIS_URL

pytestmark = pytest.mark.slow  # a benchmark's smoke run: two workers and an API of its own

BENCH = Path(__file__).resolve().parent.parent / "bench" / "fair_bench.py"


def test_fair_bench_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "models.json"
    sizes = ["--requests", "4", "--window", "5", "--repeats", "1", "--flood", "10", "--trickle", "2"]
    argv = [sys.executable, str(BENCH), *sizes, "--jobs", "5", "--redis-url", REDIS_URL, "--json", str(out)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=540, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    lines = (
        "backlogged: 2 tenants x 4 requests",
        "flood: 10 short requests",
        "service (b): 10 short jobs",
        "5 jobs each",
    )
    for line in lines:
        assert line in result.stdout, result.stdout
    figures = json.loads(out.read_text())
    assert (figures["jobs"], figures["on_own_model"], figures["per_model"]) == (10, 10, {"a": 5, "b": 5})
    prefixes = (figures["prefix"].encode(), b"fairservice-")
    left = [k for k in redis.Redis.from_url(REDIS_URL).scan_iter(count=1000) if k.startswith(prefixes)]
    assert not left, left[:10]
