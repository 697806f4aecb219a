"""bench/decode_attention_bench.py runs end to end (a smoke run: figures printed, never asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a benchmark's smoke run (it compiles too)

BENCH = Path(__file__).resolve().parent.parent / "bench" / "decode_attention_bench.py"


def test_decode_attention_bench_smoke_run_prints_every_side() -> None:
    argv = [sys.executable, str(BENCH), "--quick", "--compile", "--rounds", "1"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    for side in ("eager sdpa", "eager kernel", "compiled sdpa", "compiled kernel"):
        assert f"| {side} |" in result.stdout
    assert "texts the same: True" in result.stdout
    assert "compiled: kernel / sdpa tok/s" in result.stdout
