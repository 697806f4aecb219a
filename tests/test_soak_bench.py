"""bench/soak_bench.py runs end to end: a short soak, every request checked and nothing left
behind (its memory figures are printed, never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a benchmark's smoke run

BENCH = Path(__file__).resolve().parent.parent / "bench" / "soak_bench.py"


def test_soak_bench_short_run(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    argv = [sys.executable, str(BENCH), "--minutes", "0.2", "--clients", "16", "--json", str(out)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert figures["tally"]["failures"] == []
    assert set(figures["tally"]["done"]) == {"stream", "poll", "resume", "cancel", "openai", "bad"}
    assert figures["left"] == {
        "api_open_streams": 0,
        "job_channels_subscribed": 0,
        "job_keys_without_expiry": 0,
        "attempts_fields": 0,
    }
