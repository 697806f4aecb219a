"""bench/responses_bench.py runs end to end (a smoke run: its figures are printed, never asserted;
its accounting of a background run's events is)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a benchmark's smoke run

BENCH = Path(__file__).resolve().parent.parent / "bench" / "responses_bench.py"


def test_responses_bench_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    argv = [sys.executable, str(BENCH), "--rounds", "1", "--steps", "5", "--responses", "8", "--tokens", "12"]
    result = subprocess.run(
        [*argv, "--json", str(out)], capture_output=True, text=True, timeout=540, check=False
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert set(figures["relay"]) == {"chat_cpu_us_per_event", "responses_cpu_us_per_event"}
    bg = figures["background"]
    assert (bg["responses"], bg["resumed_on_the_other_api"]) == (8, 4)
    assert (bg["lost"], bg["repeated"], bg["bad_streams"]) == (0, 0, 0) and bg["events"] > 8 * 4
