"""bench/peers_bench.py runs end to end without llama.cpp (a smoke run: figures printed, never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a benchmark's smoke run (it compiles too)

BENCH = Path(__file__).resolve().parent.parent / "bench" / "peers_bench.py"


def test_peers_bench_smoke_run_says_llama_cpp_was_not_run(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    argv = [sys.executable, str(BENCH), "--quick", "--compile", "--rounds", "1", "--json", str(out)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "llama.cpp: not run" in result.stdout
    figures = json.loads(out.read_text())["shapes"]["quick"]
    assert set(figures["medians"]) == {"engine", "compiled", "stack"}
    assert figures["ratios"]["compiled / engine"] > 0
    stack = figures["medians"]["stack"]
    assert stack["redis_commands_per_token"] > 0 and stack["api_cpu_us_per_event"] > 0
    assert figures["ratios"]["stack / f32"] is None
