"""bench/redis_scale_bench.py runs end to end (a smoke run at tiny sizes: its figures are printed,
never asserted, but every token it made must reach its client, and each held master's cgroup
must be gone after it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a benchmark's smoke run: a one-master cluster, a broker and an API of its own

BENCH = Path(__file__).resolve().parent.parent / "bench" / "redis_scale_bench.py"
CGROUP_V1 = Path("/sys/fs/cgroup/cpu")


def cgroups_writable() -> bool:
    probe = CGROUP_V1 / "spool-redis-scale-probe"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError:
        return False
    return True


def test_redis_scale_bench_smoke_run() -> None:
    sizes = ["--workers", "1", "--batch", "4", "--steps", "20", "--rate", "200", "--apis", "1"]
    held = ["--redis-cpu", "0.5"] if cgroups_writable() else []
    before = set(CGROUP_V1.glob("spool-redis-scale-*"))
    argv = [sys.executable, str(BENCH), "--shards", "1", *sizes, *held, "--json"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    runs = json.loads(result.stdout)
    [r] = runs
    assert r["layout"] == "1 shard"
    assert r["tokens_relayed"] == r["tokens_generated"] == 4 * 20 and r["streams_ended"] == 4
    assert r["steps_per_write"] >= 1
    assert len(r["master_throttled_share"]) == (1 if held else 0)
    if held:
        assert set(CGROUP_V1.glob("spool-redis-scale-*")) == before
