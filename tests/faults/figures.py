"""One line per measured figure, so that `make test`'s output carries the fault suite's numbers."""

from __future__ import annotations

import sys


def figure(fault: str, measured: str, target: str) -> None:
    """Print ``FAULT-FIGURE <fault>: <measured> (target <target>)`` to the terminal, past pytest's capture."""
    sys.__stdout__.write(f"\nFAULT-FIGURE {fault}: {measured} (target {target})\n")
    sys.__stdout__.flush()
