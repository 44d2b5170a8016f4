"""One line per measured figure, so that `make test`'s output carries the fault suite's numbers."""

from __future__ import annotations

import sys
from typing import Any, List

FIGURES: List[str] = []
_shown = [0]


def figure(fault: str, measured: str, target: str) -> None:
    """Record ``FAULT-FIGURE <fault>: <measured> (target <target>)``; the lines are printed in pytest's
    terminal summary.  Writing to ``sys.__stdout__`` alone is not enough: pytest's default capture
    redirects file descriptor 1 itself, so such a line only reached the terminal with ``-s``."""
    line = f"FAULT-FIGURE {fault}: {measured} (target {target})"
    FIGURES.append(line)
    if not hasattr(sys.stdout, "getvalue"):  # not captured (pytest -s, or run by hand): show it now too
        sys.__stdout__.write(f"\n{line}\n")
        sys.__stdout__.flush()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print the figures recorded so far (conftests import this hook; each line is printed once even
    when two conftests register it)."""
    new = FIGURES[_shown[0]:]
    _shown[0] = len(FIGURES)
    if new:
        terminalreporter.section("fault suite figures")
        for line in new:
            terminalreporter.write_line(line)
