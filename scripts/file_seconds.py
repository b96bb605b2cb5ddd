"""Write tests/file_seconds.json, each test file's measured seconds, from a JUnit XML
report of a whole run (``PYTEST_ADDOPTS=--junitxml=FILE bash .ci/run``):

    python3 scripts/file_seconds.py FILE

tests/conftest.py hands the files to pytest-xdist longest first, so that no long file
starts last and runs alone while the other worker is idle. Only the order uses it: a
stale or missing figure costs time, never a result."""

from __future__ import annotations

import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "file_seconds.json"


def main(report: str) -> None:
    seconds: collections.Counter[str] = collections.Counter()
    root = OUT.parents[1]
    for case in ET.parse(report).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")  # tests.runtime.test_x[.TestClass]
        while parts and not (root / ("/".join(parts) + ".py")).is_file():
            parts.pop()
        if parts:
            seconds["/".join(parts) + ".py"] += float(case.get("time") or 0)
    table = {path: round(s, 1) for path, s in sorted(seconds.items()) if s >= 1.0}
    OUT.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{OUT}: {len(table)} files, {sum(table.values()):.0f} s")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python3 scripts/file_seconds.py JUNIT_XML")
    main(sys.argv[1])
