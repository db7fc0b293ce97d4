"""Count the skips of a pytest run from its JUnit XML report: print every skipped test with its
reason, and fail (exit 1) on any that .ci/expected-skips does not list.

    python .ci/skips.py REPORT.xml EXPECTED
"""

from __future__ import annotations

import fnmatch
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def node_id(case: ET.Element) -> str:
    """pytest's node id from a testcase's classname ("tests.db.test_x" or, for a test in a
    class, "tests.db.test_x.TestY") and name."""
    parts = case.get("classname", "").split(".")
    module = [p for p in parts if not p[:1].isupper()]
    classes = [p for p in parts if p[:1].isupper()]
    return "::".join(["/".join(module) + ".py", *classes, case.get("name", "?")])


def expected(path: Path) -> list[str]:
    patterns = []
    for line in path.read_text().splitlines():
        pattern = line.split(" # ", 1)[0].strip()
        if pattern and not pattern.startswith("#"):
            patterns.append(pattern)
    return patterns


def main(report: str, expected_file: str) -> int:
    if not Path(report).exists():
        print(f"ci: no test report at {report}: pytest did not get to the end", file=sys.stderr)
        return 1
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    totals = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors",
                                                                "skipped")}  # fmt: skip
    allowed = expected(Path(expected_file))
    skipped = []
    for case in root.iter("testcase"):
        skip = case.find("skipped")
        if skip is not None:
            skipped.append((node_id(case), skip.get("message", "").strip()))
    print(f"ci: {totals['tests']} tests, {totals['failures']} failed, {totals['errors']} errors,"
          f" {len(skipped)} skipped")  # fmt: skip
    unexpected = []
    for test, reason in skipped:
        ok = any(fnmatch.fnmatchcase(test, p) for p in allowed)
        print(f"ci: skipped{'' if ok else ' (NOT EXPECTED)'}: {test}: {reason}")
        if not ok:
            unexpected.append(test)
    if unexpected:
        print(f"ci: {len(unexpected)} skips not in {expected_file}: install what they need, "
              "or list them there with the reason", file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
