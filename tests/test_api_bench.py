"""bench/api_bench.py runs end to end (a smoke run: its figures are printed, never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a benchmark's smoke run

BENCH = Path(__file__).resolve().parent.parent / "bench" / "api_bench.py"


def test_api_bench_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    argv = [sys.executable, str(BENCH), "--rounds", "1", "--requests", "5", "--bursts", "1", "--steps", "5"]
    result = subprocess.run(
        [*argv, "--json", str(out)], capture_output=True, text=True, timeout=180, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    [medians] = json.loads(out.read_text())["medians"]
    assert set(medians) == {
        "post_alone_cpu_ms",
        "post_burst_cpu_ms",
        "post_burst_p50_ms",
        "open_finished_cpu_ms",
        "open_live_cpu_ms",
        "streamed_cpu_us_per_event",
        "streamed_chat_cpu_us_per_event",
        "streamed_responses_cpu_us_per_event",
        "not_streamed_cpu_us_per_event",
    }
