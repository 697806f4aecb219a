"""`spool batch` and `spool batches` on the Batches API, against a real cluster."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

from procs import SPOOL, Cluster, wait_until


def spool(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SPOOL, *args], check=False, capture_output=True, text=True, timeout=timeout)


def test_batch_runs_a_file_and_writes_its_output_and_error_files(cluster: Cluster, tmp_path: Path) -> None:
    rows = [
        {"custom_id": f"r{i}", "prompt": f"hello {i}", "max_tokens": 6, "temperature": 0} for i in range(3)
    ]
    rows.append({"custom_id": "bad", "prompt": "x", "temperature": 9})  # the endpoint's 422
    rows.append({"prompt": "no custom id", "max_tokens": 2})  # named after its line
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = spool("batch", str(src), "--url", cluster.url)
    assert result.returncode == 1, result.stderr  # one line failed
    assert "5/5 (4 completed, 1 failed) completed" in result.stderr
    out = [json.loads(x) for x in (tmp_path / "in.output.jsonl").read_text().splitlines()]
    errors = [json.loads(x) for x in (tmp_path / "in.errors.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in out] == ["r0", "r1", "r2", "line-5"]
    assert all(r["response"]["body"]["status"] == "succeeded" for r in out)
    assert [(r["custom_id"], r["response"]["status_code"]) for r in errors] == [("bad", 422)]


def test_an_interrupted_batch_is_resumed_and_listed(cluster: Cluster, tmp_path: Path) -> None:
    rows = [{"custom_id": f"r{i}", "prompt": "the quick brown fox", "max_tokens": 64} for i in range(40)]
    src, log = tmp_path / "in.jsonl", tmp_path / "stderr.txt"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with log.open("w") as err:
        proc = subprocess.Popen([SPOOL, "batch", str(src), "--url", cluster.url], stderr=err)
    try:
        wait_until(lambda: "resume with" in log.read_text(), "the batch created", 60)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
    finally:
        proc.kill()
    assert "spool batch --resume" in log.read_text()
    [batch_id] = set(re.findall(r"batch_[0-9a-f]+", log.read_text()))
    assert batch_id in spool("batches", "--url", cluster.url).stdout
    out = tmp_path / "resumed.jsonl"
    result = spool("batch", "--resume", batch_id, "--out", str(out), "--url", cluster.url)
    assert result.returncode == 0, result.stderr
    assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == [
        r["custom_id"] for r in rows
    ]
    assert (tmp_path / "resumed.errors.jsonl").read_text() == ""  # beside --out, not in the working directory
