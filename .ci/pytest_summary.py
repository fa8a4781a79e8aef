"""Reads the output of a pytest run (stdin) and says whether CI accepts it: pytest printed its final summary with at
least one passed test and no skipped, xfailed or xpassed one (each hides a failure), and its table of the slowest
tests. Prints the run's wall time and that table; exits 1 after a `CI: ...` line for each problem found."""

from __future__ import annotations

import re
import sys
from typing import NamedTuple

# pytest's last line: "===== 3 failed, 120 passed, 2 skipped, 4 warnings in 1080.23s (0:18:00) =====", or "no tests
# ran in 0.01s" (no bars with -q).
SUMMARY = re.compile(r"^=* ?(?P<counts>(?:\d+ \w+, )*\d+ \w+|no tests ran)"
                     r" in (?P<seconds>\d+(?:\.\d+)?)s(?: \((?P<clock>[\d:]+)\))? ?=*$")
COUNT = re.compile(r"(\d+) (\w+)")
DURATIONS = re.compile(r"^=+ slowest (?:\d+ )?durations =+$")
HIDDEN = ("skipped", "xfailed", "xpassed")


class Summary(NamedTuple):
    counts: dict[str, int]  # "passed", "failed", "skipped", "xfailed", "xpassed", "errors", "warnings", ...
    seconds: float
    clock: str | None  # pytest's h:mm:ss, when the run took a minute or more


def final_summary(lines: list[str]) -> Summary | None:
    """pytest's last summary line in `lines`, parsed (None if there is none)."""
    for line in reversed(lines):
        if match := SUMMARY.match(line.strip()):
            counts = {kind: int(n) for n, kind in COUNT.findall(match["counts"])}
            return Summary(counts, float(match["seconds"]), match["clock"])
    return None


def slowest(lines: list[str]) -> list[str]:
    """The rows of pytest's `--durations` table (empty if it printed none)."""
    for i, line in enumerate(lines):
        if DURATIONS.match(line.strip()):
            rows = []
            for row in lines[i + 1:]:
                if row.startswith("="):
                    break
                if row.strip():
                    rows.append(row)
            return rows
    return []


def problems(summary: Summary | None, durations: list[str]) -> list[str]:
    if summary is None:
        return ["pytest printed no final summary line (did it run?)"]
    found = [f"pytest reported {summary.counts[kind]} {kind}; CI allows none (a skip or an xfail hides a failure)"
             for kind in HIDDEN if summary.counts.get(kind)]
    if not summary.counts.get("passed"):
        found.append("pytest reported no passing tests")
    if not durations:
        found.append("pytest printed no table of the slowest tests (pyproject's addopts should have --durations=25)")
    return found


def main() -> int:
    lines = sys.stdin.read().splitlines()
    summary, durations = final_summary(lines), slowest(lines)
    if durations:
        print("CI: the slowest tests")
        print("\n".join(durations))
    if summary is not None:
        clock = f" ({summary.clock})" if summary.clock else ""
        print(f"CI: pytest wall time {summary.seconds:.1f} s{clock}")
    found = problems(summary, durations)
    for problem in found:
        print(f"CI: {problem}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
