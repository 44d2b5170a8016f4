"""netproxy laid out as the wheel installs it, for the lint tools that name a module by its folder.

backends/ is a top-level folder in the repository but is installed as netproxy.backends (pyproject's
package-dir); the lab (lab/netproxy_lab) is its own distribution, installed beside netproxy.  mypy and
import-linter have no such mapping, and the editable install reaches backends/ through an import hook
that neither runs: checked in place, netproxy.backends does not exist for them.  So scripts/lint-types
and scripts/lint-structure check a copy made here.  A copy rather than symlinks: import-linter walks
real folders only, and copytree keeps the files' mtimes, so mypy's incremental cache stays valid.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Tuple

REPO = Path(__file__).resolve().parent.parent

LAYOUT: Tuple[Tuple[str, str], ...] = (
    ("netproxy", "netproxy"),
    ("backends", "netproxy/backends"),  # pyproject.toml: package-dir "netproxy.backends" = "backends"
    ("lab/netproxy_lab", "netproxy_lab"),
)
"""(folder in the repository, folder in the installed layout), each inside the one before it."""


def build(root: Path) -> None:
    """Copy the installed layout into ``root`` (an empty folder)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for source, installed in LAYOUT:
        shutil.copytree(REPO / source, root / installed, ignore=ignore)


def repo_path(installed: str) -> str:
    """A path relative to the installed layout's root as the repository's (``netproxy/backends/x.py``
    -> ``backends/x.py``), so that a tool's message names the file to edit; other paths unchanged."""
    for source, folder in sorted(LAYOUT, key=lambda pair: -len(pair[1])):  # netproxy/backends before netproxy
        if installed == folder or installed.startswith(folder + "/"):
            return source + installed[len(folder):]
    return installed
