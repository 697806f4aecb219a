"""bench/engine_bench.py runs end to end (a smoke run: its figures are printed, never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "engine_bench.py"

pytestmark = pytest.mark.slow  # a benchmark's smoke run


def test_engine_bench_smoke_run_has_every_section_and_row(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    argv = [sys.executable, str(BENCH), "--quick", "--threads", "1", "--json", str(out)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(out.read_text())
    rows = {s: list(figures[s]["rows"]) for s in ("uniform", "mixed", "prefix")}
    assert rows == {
        "uniform": ["ceiling", "generate", "generate_batch", "engine", "engine_nocache"],
        "mixed": ["ceiling", "static", "transformers_cb", "engine", "engine_nocache"],
        "prefix": ["shared_off", "turns_off", "shared_on", "turns_on", "shared_transformers_cb"],
    }
    for section in ("uniform", "mixed"):  # every row generated the workload's tokens (checked as it ran)
        ratios = figures[section]["ratios"]
        assert len(ratios) == 5 and all(v is not None for v in ratios.values()), ratios
    assert set(figures["decode"]["ms"]) == {"16", "128"}
    assert set(figures["structured"]) == {"unconstrained", "quarter_schema", "mask_ms_per_step", "ttft_s"}
    assert "== summary" in result.stdout
