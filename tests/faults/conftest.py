"""Fault suite (issue 16): netproxy under crashes, flushes, lock fights, hostile input, storms and API
outages. Kernel faults run inside the namespace harness of ``tests/kernel`` (same fixtures, same
backend/writer parametrisation); each test prints the figure the issue asks for with ``figure()``."""

import sys
from pathlib import Path

# The kernel harness is a plain module beside its tests; the fault suite reuses it rather than copying it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernel"))

from figures import pytest_terminal_summary  # noqa: E402,F401  (prints the FAULT-FIGURE lines)
from harness import (  # noqa: E402,F401  (fixtures and the parametrisation hook, re-exported for pytest)
    bare_sandbox,
    combo,
    kernel_env,
    proxy,
    pytest_generate_tests,
    sandbox,
)
