"""The README's settings table and the Settings object say the same thing."""

from __future__ import annotations

import re
from pathlib import Path

from common.settings import ENV_PREFIX, Settings

ROOT = Path(__file__).resolve().parents[1]
# Variables the README mentions that belong to the scripts and tests, not to Settings.
NOT_SETTINGS = {"SPOOL_TEST_REDIS_URL"}


def test_readme_settings_table_matches_settings() -> None:
    readme = (ROOT / "README.md").read_text()
    table = set(re.findall(r"^\| `(SPOOL_[A-Z_]+)` \|", readme, flags=re.M))
    fields = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    assert table == fields


def test_docs_mention_only_real_settings() -> None:
    fields = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        mentioned = set(re.findall(r"\bSPOOL_[A-Z_]+[A-Z]\b", path.read_text()))
        assert mentioned - fields - NOT_SETTINGS == set(), path.name
