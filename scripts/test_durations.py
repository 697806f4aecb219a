"""Writes tests/durations.json, the seconds each test file took, from a run's JUnit XML:

    scripts/test.sh --junitxml=run.xml && .venv/bin/python scripts/test_durations.py run.xml

tests/conftest.py starts the longest files first (pytest-xdist then hands them out in that order),
so a long file does not start last and hold the run open while the other process idles. Run it
again when files are added or change their length a lot; a file it does not name counts as the
median.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "durations.json"


def main(junit_xml: str) -> None:
    seconds: Counter[str] = Counter()
    for case in ET.parse(junit_xml).iter("testcase"):
        # classname "tests.reliability.test_x" (+ ".Class"): the file is its path up to the test_ module.
        parts = case.get("classname", "").split(".")
        module = next(i for i, p in reversed(list(enumerate(parts))) if p.startswith("test_"))
        seconds["/".join(parts[: module + 1]) + ".py"] += float(case.get("time", 0))
    ranked = dict(sorted(((f, round(s, 1)) for f, s in seconds.items()), key=lambda fs: -fs[1]))
    OUT.write_text(json.dumps(ranked, indent=1) + "\n")
    print(f"{OUT}: {len(ranked)} files, {sum(ranked.values()):.0f} s in all")


if __name__ == "__main__":
    main(sys.argv[1])
