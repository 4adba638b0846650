#!/usr/bin/env python3
"""Fails when a test that should run on this (CPU) machine was skipped.

ctest counts a skipped test (gtest's GTEST_SKIP, through gtest_discover_tests' skip pattern) as
passed, and a pytest run with skips is one passing ctest test: a wrong BGL_LIB_DIR would skip
most of the Python suite and still pass. scripts/test.sh writes ctest's and pytest's JUnit XML
and runs this over them; every skip must match an entry of the allow-list, each of which gives
its reason.

usage: check_skips.py --suite NAME --allow FILE [--ctest XML]... [--pytest XML]...

Allow-list lines: SUITE PATTERN REASON...
  SUITE    the suite name (release, asan+ubsan, asan-python, tsan) or * for all
  PATTERN  an fnmatch pattern over the test's id: the ctest name (Suite.Test, as
           gtest_discover_tests names it, or python.pytest) or the pytest id
           (tests/python/test_x.py::test_y[param])
  REASON   why the test cannot run there (required)
'#' starts a comment. An entry no test matched is reported (a note, not a failure: suites and
machines differ).
"""
import argparse
import fnmatch
import re
import sys
import xml.etree.ElementTree as ET


def load_allow(path):
    entries, problems = [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split(None, 2)
            if len(parts) < 3 or not parts[2].strip():
                problems.append(f"{path}:{n}: an entry needs SUITE PATTERN REASON: {line!r}")
                continue
            entries.append({"suite": parts[0], "pattern": parts[1], "reason": parts[2],
                            "line": n, "used": 0})
    return entries, problems


def gtest_reason(case):
    """The message GTEST_SKIP printed, from the test's captured output."""
    out = "".join(e.text or "" for e in case.iter("system-out"))
    m = re.search(r"Skipped\n(.*?)\n?\[  SKIPPED", out, re.S)
    if m and m.group(1).strip():
        return " ".join(m.group(1).split())[:200]
    skipped = case.find("skipped")
    return (skipped.get("message") if skipped is not None else "") or "(no reason given)"


def ctest_skips(path):
    """(id, reason) of the tests ctest did not run to a pass or a failure."""
    skips, ran = [], 0
    for case in ET.parse(path).getroot().iter("testcase"):
        ran += 1
        status = case.get("status", "")
        if case.find("skipped") is not None or status in ("notrun", "disabled", "skipped"):
            skips.append((case.get("name", "?"), gtest_reason(case)))
    return skips, ran


def pytest_id(case):
    """tests/python/test_x.py::test_y[param] from pytest's classname and name."""
    classname = case.get("classname", "")
    parts = classname.split(".")
    # Test classes start with an upper-case letter; the rest is the module path.
    cls = []
    while parts and parts[-1][:1].isupper():
        cls.insert(0, parts.pop())
    module = "/".join(parts) + ".py" if parts else ""
    return "::".join([module] + cls + [case.get("name", "?")])


def pytest_skips(path):
    skips, ran = [], 0
    for case in ET.parse(path).getroot().iter("testcase"):
        ran += 1
        skipped = case.find("skipped")
        if skipped is not None:
            reason = skipped.get("message") or (skipped.text or "").strip() or "(no reason)"
            skips.append((pytest_id(case), " ".join(reason.split())[:200]))
    return skips, ran


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", required=True)
    ap.add_argument("--allow", required=True)
    ap.add_argument("--ctest", action="append", default=[])
    ap.add_argument("--pytest", action="append", default=[])
    args = ap.parse_args()
    entries, problems = load_allow(args.allow)
    entries = [e for e in entries if e["suite"] in ("*", args.suite)]
    skips, total = [], 0
    for path in args.ctest:
        s, n = ctest_skips(path)
        skips += s
        total += n
    for path in args.pytest:
        s, n = pytest_skips(path)
        skips += s
        total += n
    if total == 0:
        problems.append("no test results in " + " ".join(args.ctest + args.pytest))
    allowed = 0
    for test, reason in skips:
        match = next((e for e in entries if fnmatch.fnmatchcase(test, e["pattern"])), None)
        if match is None:
            problems.append(f"skipped but expected to run on this machine: {test} ({reason})")
        else:
            match["used"] += 1
            allowed += 1
            print(f"skip allowed: {test}: {match['reason']}")
    for e in entries:
        if not e["used"]:
            print(f"note: {args.allow}:{e['line']}: no {args.suite} test matched {e['pattern']}")
    for p in problems:
        print("FAIL:", p)
    print(f"{args.suite}: {total} tests, {len(skips)} skipped ({allowed} on the allow-list)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
