"""The README says what the code does: its settings table is the Settings object's, and its
examples run as written (the batch snippet against a live cluster, the parts example's events
are ones its request can produce)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest
from procs import Cluster

from common.settings import ENV_PREFIX, Settings

ROOT = Path(__file__).resolve().parents[1]


def test_readme_settings_table_matches_settings() -> None:
    readme = (ROOT / "README.md").read_text()
    table = set(re.findall(r"^\| `(SPOOL_[A-Z_]+)` \|", readme, flags=re.MULTILINE))
    fields = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    assert table == fields


def test_docs_and_scripts_mention_only_real_settings() -> None:
    # Every process refuses unknown SPOOL_* variables, so a script or doc that set one would break it.
    fields = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    paths = [
        ROOT / "README.md",
        ROOT / "Dockerfile",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "scripts").glob("*.sh"),
    ]
    for path in sorted(paths):
        mentioned = set(re.findall(r"\bSPOOL_[A-Z_]+[A-Z]\b", path.read_text()))
        assert mentioned - fields == set(), path.name


def readme_block(lang: str, containing: str) -> str:
    """The README's ```lang block that contains ``containing``."""
    readme = (ROOT / "README.md").read_text()
    [block] = [b for b in re.findall(rf"^```{lang}\n(.*?)^```", readme, re.M | re.S) if containing in b]
    return str(block)


def test_readme_batch_snippet_runs_as_written(
    cluster: Cluster,
    oai: openai.OpenAI,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": f"line {i}"}], "max_tokens": 4},
        }
        for i in range(2)
    ]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    monkeypatch.chdir(tmp_path)
    exec(readme_block("python", "client.batches.create"), {"client": oai})  # the README's `client`
    out = capsys.readouterr().out
    assert out.startswith("completed ")
    results = [json.loads(line) for line in out.splitlines()[1:] if line.startswith("{")]
    assert sorted(r["custom_id"] for r in results) == ["r0", "r1"]
    assert all(r["response"]["status_code"] == 200 for r in results)


def test_readme_parts_example_shows_only_events_its_request_can_produce() -> None:
    block = readme_block("bash", '"parts"')
    body = json.loads(block.split("-d '", 1)[1].split("'", 1)[0])
    # (the done event's sample elides its parts: "[{...each part's summary...}]")
    found = re.findall(r"^# event: (\w+)\s+data: (\{.*\})$", block, re.M)
    events = [json.loads(d) | {"event": e} for e, d in found if e != "done"]
    assert {e["event"] for e in events} >= {"part", "token", "progress", "preview"}
    parts = body["parts"]
    assert all("timeout_s" not in p for p in parts)  # counted from the job's creation: a 2-core CPU misses it
    for e in events:
        part = parts[e["part"]] if "part" in e and isinstance(e["part"], int) else None
        if e["event"] == "preview":
            assert part is not None and part.get("partial_images", 0) >= 1, e
        if e["event"] in ("progress", "preview"):
            assert part is not None and e["step"] <= part["steps"], e
        if e["event"] == "part" and "width" in e:
            assert part is not None and part["size"] == f"{e['width']}x{e['height']}", e
