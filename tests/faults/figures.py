"""One line per measured figure, so that `make test`'s output carries the fault suite's numbers.

Registered once for the whole run as a plugin (the root ``conftest.py``).  Under pytest-xdist a test
runs in a worker, whose terminal is never shown: so a figure travels in its test's report
(``user_properties``, which xdist sends to the controller and the JUnit XML keeps), and the process
that prints the summary — the controller, or pytest itself without xdist — collects the lines from
the reports it logs."""

from __future__ import annotations

import sys
from typing import Any, Generator, List, Set, Tuple

import pytest

PROPERTY = "fault-figure"
FIGURES: List[str] = []
"""The lines this process has seen in the run's reports, in order: what the summary prints."""
_pending: List[str] = []  # recorded by the running test, not yet in one of its reports
_seen: Set[Tuple[str, str]] = set()  # (test, line): a test's three reports share its user_properties
_shown = [0]


def figure(fault: str, measured: str, target: str) -> None:
    """Record ``FAULT-FIGURE <fault>: <measured> (target <target>)``; the lines are printed in pytest's
    terminal summary.  Writing to ``sys.__stdout__`` alone is not enough: pytest's default capture
    redirects file descriptor 1 itself, so such a line only reached the terminal with ``-s``."""
    line = f"FAULT-FIGURE {fault}: {measured} (target {target})"
    _pending.append(line)
    if not hasattr(sys.stdout, "getvalue"):  # not captured (pytest -s, or run by hand): show it now too
        sys.__stdout__.write(f"\n{line}\n")
        sys.__stdout__.flush()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport,
                                                                                           pytest.TestReport]:
    report = yield
    if _pending:
        report.user_properties.extend((PROPERTY, line) for line in _pending)
        del _pending[:]
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for name, value in report.user_properties:
        if name == PROPERTY and (report.nodeid, str(value)) not in _seen:
            _seen.add((report.nodeid, str(value)))
            FIGURES.append(str(value))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print the figures reported so far, each once."""
    new = FIGURES[_shown[0]:]
    _shown[0] = len(FIGURES)
    if new:
        terminalreporter.section("fault suite figures")
        for line in new:
            terminalreporter.write_line(line)
