"""Where a test run's time went, from its JUnit XML (``make test-full`` writes ``var/ci/junit.xml``):
``python -m tests.durations var/ci/junit.xml [--slowest 20] [--by-file]``."""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import Counter


def read(path: str) -> list[tuple[float, str, str]]:
    """``(seconds, file, test)`` of every test case (setup and teardown included)."""
    root = ET.parse(path).getroot()
    return [(float(tc.get("time") or 0), tc.get("classname", "").replace(".", "/") + ".py", tc.get("name", ""))
            for tc in root.iter("testcase")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit")
    parser.add_argument("--slowest", type=int, default=20)
    parser.add_argument("--by-file", action="store_true", help="seconds per test file instead")
    args = parser.parse_args(argv)
    cases = read(args.junit)
    total = sum(c[0] for c in cases)
    if args.by_file:
        by_file: Counter[str] = Counter()
        for seconds, file, _ in cases:
            by_file[file] += seconds
        for file, seconds in by_file.most_common():
            print(f"{seconds:8.1f} s  {100 * seconds / total:5.1f} %  {file}")
    else:
        print(f"==> the {args.slowest} slowest of {len(cases)} tests ({total / 60:.1f} min of test time in all):")
        for seconds, file, name in sorted(cases, reverse=True)[: args.slowest]:
            print(f"{seconds:8.1f} s  {file}::{name}")


if __name__ == "__main__":
    main()
