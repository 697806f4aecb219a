"""bench/scoring_bench.py runs end to end (a smoke run at tiny sizes: its figures are printed,
never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a benchmark's smoke run: a redis-server, a worker and an API of its own

BENCH = Path(__file__).resolve().parent.parent / "bench" / "scoring_bench.py"


def test_scoring_bench_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "scoring.json"
    sizes = ["--requests", "16", "--per-request", "4", "--clients", "2", "--batch", "4", "--model", "quick"]
    argv = [sys.executable, str(BENCH), *sizes, "--json", str(out)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=540, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "scored tokens/s: stack" in result.stdout, result.stdout
    figures = json.loads(out.read_text())
    assert figures["stack_tok_s"] > 0 and figures["transformers_tok_s"] > 0
