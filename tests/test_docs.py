"""The docs say what the code does: the README's settings table is the Settings object's, its parts
example's events are ones its request can produce, the docs' links and named sections exist, and
docs/internals.md's glossary stays short and its thread table names every text worker thread.
(Every README command and snippet runs against a live `spool up` in test_readme_runs.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

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


def anchors(path: Path) -> set[str]:
    """The #fragments of a Markdown file's headings, as GitHub makes them (a repeat gets -1, -2)."""
    found: set[str] = set()
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    for heading in re.findall(r"^#{1,6} (.*)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = 0
        while (f"{slug}-{n}" if n else slug) in found:
            n += 1
        found.add(f"{slug}-{n}" if n else slug)
    return found


def test_docs_links_reach_their_files_and_headings() -> None:
    # A section moved to another file (docs/operations.md took the running of Spool from
    # docs/internals.md) must take its links along.
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, fragment = target.partition("#")
            file = (doc.parent / path).resolve() if path else doc
            assert file.exists(), (doc.name, target)
            if fragment and file.suffix == ".md":
                assert fragment in anchors(file), (doc.name, target)


def test_sections_named_in_docs_and_code_are_in_the_doc_they_name() -> None:
    # Docs, code comments and --help texts name a section as docs/<file>.md "Its title", or
    # link to its heading's anchor.
    sources = [ROOT / "README.md", ROOT / "docker-compose.yml", *(ROOT / "docs").glob("*.md")]
    for package in ("api", "common", "workers", "spool_cli", "bench", "scripts", "tests"):
        sources += (ROOT / package).rglob("*.py")
    for source in sorted(sources):
        text = source.read_text()
        for name, title in re.findall(r'docs/([\w.-]+\.md)[,:]? \(?"([^"]+)"', text):
            doc = " ".join((ROOT / "docs" / name).read_text().split())
            assert " ".join(title.split()) in doc, (source.name, name, title)
        for name, fragment in re.findall(r"docs/([\w.-]+\.md)#([\w-]+)", text):
            assert fragment in anchors(ROOT / "docs" / name), (source.name, name, fragment)


def internals_section(title: str) -> str:
    """The text of docs/internals.md's ``## title`` section, up to the next ``## `` heading."""
    text = (ROOT / "docs" / "internals.md").read_text()
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_glossary_names_at_most_20_concepts() -> None:
    rows = re.findall(r"^\| (?!concept \||---)([^|]+) \|", internals_section("Glossary"), re.M)
    assert 0 < len(rows) <= 20, rows


def test_the_thread_table_names_every_thread_of_the_text_worker() -> None:
    # The text worker's modules are workers/*.py (the media and hook workers' are in their folders).
    names = {
        n
        for p in (ROOT / "workers").glob("*.py")
        for n in re.findall(r'name="(spool-[\w-]+)"', p.read_text())
    }
    table = internals_section("The text worker's threads")
    assert names and {n for n in names if f"`{n}`" not in table} == set()
