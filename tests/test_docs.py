"""The README's settings table and the Settings object say the same thing."""

from __future__ import annotations

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
