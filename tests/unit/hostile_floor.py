"""The hostile-input module's 5,000-case floor, judged over the whole run (a plugin: the root
``conftest.py`` registers it).

Under pytest-xdist the module's five generated tests are spread over the workers, so no test inside
the module can see every count (a floor test counting its own process skipped almost always under
``-n 2``).  Each of the five tests puts the number of cases it ran in its report instead
(``user_properties``, which xdist sends to the controller); the process that logs the reports — the
controller, or pytest itself without xdist — adds them up at the end of the session, prints the
figure, and fails the run when all five ran and their sum is under the floor."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest

from tests.faults import figures

PROPERTY = "hostile-cases"
FLOOR = 5000
TESTS = 5
"""The generated tests of tests/unit/test_hostile_input.py whose cases count toward the floor."""

_cases: Dict[str, int] = {}
_verdict: List[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # The count is added by the test's fixture at teardown: it is in the teardown report (and, without
    # xdist, in the others too: a test's reports share its user_properties).
    for name, value in report.user_properties:
        if name == PROPERTY:
            _cases[report.nodeid] = int(str(value))


def judge(cases: Dict[str, int]) -> List[str]:
    """The summary's lines for these counts (empty: the module did not run); the first says whether
    the floor failed (``FAILED``)."""
    if not cases:
        return []
    total = sum(cases.values())
    per_test = ", ".join(str(n) for _, n in sorted(cases.items()))
    if len(cases) < TESTS:
        return [f"hostile-input floor not judged: {len(cases)} of its {TESTS} tests ran ({per_test} cases)"]
    if total < FLOOR:
        return [f"FAILED hostile-input floor: {total:,} generated cases ({per_test}), under {FLOOR:,}"]
    return [f"hostile-input floor met: {total:,} generated cases ({per_test})"]


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller judges
        return
    _verdict[:] = judge(_cases)
    if not _verdict:
        return
    if len(_cases) == TESTS:
        total = sum(_cases.values())
        figures.FIGURES.append(
            f"FAULT-FIGURE hostile manifests, in process: {total:,} generated cases "
            f"({', '.join(str(n) for _, n in sorted(_cases.items()))}): 0 tracebacks, 0 injections "
            f"(target >= {FLOOR:,} cases, 0 tracebacks, 0 injections)")
    if _verdict[0].startswith("FAILED"):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for line in _verdict:
        terminalreporter.write_line(line, red=line.startswith("FAILED"))
