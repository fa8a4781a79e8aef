"""`.ci/run`'s verdict on pytest's output (`.ci/pytest_summary.py`), on what this pytest really prints: a run with a
skipped, xfailed or xpassed test fails CI, and a clean run passes with its wall time and slowest tests printed."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO_ROOT

SUMMARY_SCRIPT = REPO_ROOT / ".ci" / "pytest_summary.py"

TESTS = {
    "passed": "def test_passes():\n    pass\n",
    "skipped": "import pytest\n\ndef test_skips():\n    pytest.skip('not here')\n",
    "xfailed": "import pytest\n\n@pytest.mark.xfail\ndef test_fails():\n    assert False\n",
    "xpassed": "import pytest\n\n@pytest.mark.xfail\ndef test_passes_anyway():\n    pass\n",
}


def pytest_output(tmp_path, *outcomes: str) -> str:
    """What pytest prints, with the project's `-ra --durations=25`, for one test per outcome in `outcomes`."""
    for outcome in outcomes:
        (tmp_path / f"test_{outcome}.py").write_text(TESTS[outcome])
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-ra", "--durations=25",
                          str(tmp_path)], cwd=tmp_path, capture_output=True, text=True)
    return run.stdout


def verdict(text: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SUMMARY_SCRIPT)], input=text, capture_output=True, text=True)


def test_a_clean_run_passes_with_its_wall_time_and_slowest_tests(tmp_path):
    output = pytest_output(tmp_path, "passed")
    result = verdict(output)
    assert result.returncode == 0, result.stdout
    assert "CI: the slowest tests" in result.stdout and "CI: pytest wall time " in result.stdout
    # The same run without its table of the slowest tests (`--durations` dropped from addopts) fails.
    without_table = "\n".join(line for line in output.splitlines() if "slowest 25 durations" not in line)
    result = verdict(without_table)
    assert result.returncode == 1 and "--durations=25" in result.stdout, result.stdout


def test_a_skipped_xfailed_or_xpassed_test_fails_ci(tmp_path):
    result = verdict(pytest_output(tmp_path, "passed", "skipped", "xfailed", "xpassed"))
    assert result.returncode == 1
    for hidden in ("skipped", "xfailed", "xpassed"):
        assert f"CI: pytest reported 1 {hidden}" in result.stdout, result.stdout


def test_output_without_pytests_summary_or_a_passed_test_fails_ci():
    assert "no final summary" in verdict("make: *** [Makefile:66: test] Error 2\n").stdout
    ran_nothing = "===== slowest 25 durations =====\n===== no tests ran in 0.01s =====\n"
    result = verdict(ran_nothing)
    assert result.returncode == 1 and "no passing tests" in result.stdout, result.stdout


def test_the_project_keeps_the_slowest_tests_table_and_the_skip_reasons():
    addopts = (REPO_ROOT / "pyproject.toml").read_text().split("addopts = ", 1)[1].split("\n", 1)[0]
    assert "--durations=25" in addopts and "-ra" in addopts
