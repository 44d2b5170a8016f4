"""netproxy's modules compiled to bytecode before any process is timed: the bench measures netproxy
as a node runs it, installed.

pip compiles every module it installs (a wheel, the image's virtualenv: deploy/Containerfile), so an
installed ``netproxy sync`` reads bytecode.  A checkout is run from its sources, and with
``PYTHONDONTWRITEBYTECODE`` set (this environment and CI set it) every process compiles each module
it imports again: 0.09 s of every ``netproxy sync``'s start here (importing what ``sync`` imports
took 0.28-0.29 s from the sources and 0.19-0.20 s from bytecode, by hand, 2026-12-05), a cost no
node pays.  Compiling writes ``__pycache__`` next to the sources (ignored by git); Python checks
each file's modification time, so a changed source is never run from stale bytecode.
"""

from __future__ import annotations

import compileall
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("netproxy", "backends")


def precompile(root: str = ROOT) -> None:
    """Compile the packages under ``root`` (a checkout, or a revision's tree) as pip would."""
    for package in PACKAGES:
        path = os.path.join(root, package)
        if os.path.isdir(path) and not compileall.compile_dir(path, quiet=1):
            raise SystemExit(f"bench: compiling {path} failed")
