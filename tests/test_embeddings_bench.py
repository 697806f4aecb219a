"""bench/embeddings_bench.py runs end to end (a smoke run: its figures are printed, never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a benchmark's smoke run

BENCH = Path(__file__).resolve().parent.parent / "bench" / "embeddings_bench.py"


def test_embeddings_bench_smoke_run() -> None:
    argv = [sys.executable, str(BENCH), "--inputs", "64", "--per-request", "8", "--clients", "2"]
    result = subprocess.run(
        [*argv, "--size", "tiny", "--rounds", "1"], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["inputs"] == 64 and report["ratio"] > 0
