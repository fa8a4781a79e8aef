"""What the repository's text promises a reader: no work-log references, results files with provenance, and docs
whose figures come from those files. Pure file reading over git-tracked files; no Ray, no engines."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from benchmarks import report

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results"

# Run numbers and references to the sessions that produced a change: history is git's, a reader cannot act on them.
# (Written with character classes so that this file does not match itself.)
WORK_LOG = re.compile(r"\bstop ?[0-9]{1,3}\b|this[ ]session|another[ ]session|in[ ]one[ ]session", re.IGNORECASE)
RESULTS_NAME = re.compile(r"benchmarks/results/([\w.-]+\.(?:json|md|png))")


def tracked_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True).stdout
    return [REPO_ROOT / name for name in listed.decode().split("\0") if name]


def text_of(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:  # listed by git but deleted in the working tree
        return None
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", errors="replace")


def docs() -> list[Path]:
    return [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def canonical_results() -> list[Path]:
    return sorted(RESULTS.glob("*.json"))


def test_no_tracked_file_carries_work_log_references():
    found = []
    for path in tracked_files():
        text = text_of(path)
        if text is None:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if WORK_LOG.search(line):
                found.append(f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()[:120]}")
    assert not found, "reword these without run numbers or sessions (history is git's):\n" + "\n".join(found)


def test_every_results_file_the_docs_name_exists():
    # Files a report section expects but that nobody has measured yet render as "not measured yet".
    expected_later = {name for section in report.SECTIONS for name in section.files}
    missing = []
    for doc in docs():
        for name in set(RESULTS_NAME.findall(doc.read_text())):
            if not (RESULTS / name).exists() and name not in expected_later:
                missing.append(f"{doc.relative_to(REPO_ROOT)} names benchmarks/results/{name}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("path", canonical_results(), ids=lambda p: p.name)
def test_every_results_json_records_its_provenance(path: Path):
    result = json.loads(path.read_text())
    provenance = result.get("provenance")
    assert isinstance(provenance, dict), f"{path.name}: no provenance (benchmarks save with common.write_result)"
    for field in ("commit", "command", "date", "machine"):
        assert provenance.get(field), f"{path.name}: provenance has no {field}"
    for plot in result.get("plots", []):
        assert (REPO_ROOT / plot).exists(), f"{path.name} names a plot that is not there: {plot}"


def test_the_benchmark_docs_are_generated_from_the_results_files():
    results = report.load()
    assert report.DOC.read_text() == report.render_doc(results), \
        "docs/benchmarks.md differs from the results files: run `python -m benchmarks.report`"
    readme = report.README.read_text()
    assert report.README_BEGIN in readme and report.README_END in readme
    assert report.with_readme_block(readme, results) == readme, \
        "README.md's results table differs from the results files: run `python -m benchmarks.report`"


def test_a_missing_results_file_renders_as_not_measured(tmp_path: Path):
    (tmp_path / "multi_turn.json").write_text((RESULTS / "multi_turn.json").read_text())
    text = report.render_doc(report.load(tmp_path))
    assert "Not measured yet: no `benchmarks/results/soak.json`." in text
    assert "## Multi-turn routing: quick" in text and "| kvrelay |" in text


def test_a_fleet_simulation_renders_once_its_file_exists(tmp_path: Path):
    fleet = {"profile": "h100", "replicas": 8, "topology": "aggregated",
             "workloads": {"chat": {"policies": {"kvrelay": {"ttft_ms": {"p50": 120.0, "p90": 300.0, "p99": 900.0},
                                                             "goodput_rps": 40.5, "pulls": 12,
                                                             "reused_token_share": 0.8}}}},
             "provenance": {"commit": "abc", "command": "python -m benchmarks.fleet_sim", "date": "d", "machine": {}}}
    (tmp_path / "fleet.json").write_text(json.dumps(fleet))
    text = report.render_doc(report.load(tmp_path))
    assert "| chat | kvrelay | 120.0 | 300.0 | 900.0 | 40.5 | 12 | 80% |" in text


def test_the_readme_stays_a_users_guide():
    lines = (REPO_ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 350, f"README.md has {len(lines)} lines: move design to docs/design.md, figures to results"
