"""The wheel carries the product and only the product: every package under netproxy/ and backends/
(a package missing from pyproject's list would be missing from the wheel and the image, though an
editable install finds it), and no lab or tests (the lab is its own distribution, lab/)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Set

if sys.version_info >= (3, 11):
    import tomllib
else:  # the Debian 11 guest's Python 3.9
    tomllib = None

import pytest

REPO = Path(__file__).resolve().parents[2]


def _listed() -> Set[str]:
    if tomllib is None:
        pytest.skip("tomllib is Python 3.11+")
    with open(REPO / "pyproject.toml", "rb") as f:
        return set(tomllib.load(f)["tool"]["setuptools"]["packages"])


def _on_disk() -> Set[str]:
    found = {".".join(("netproxy",) + p.parent.relative_to(REPO / "netproxy").parts)
             for p in (REPO / "netproxy").rglob("__init__.py")}
    found |= {".".join(("netproxy", "backends") + p.parent.relative_to(REPO / "backends").parts)
              for p in (REPO / "backends").rglob("__init__.py")}
    return found


def test_the_wheel_lists_every_package_of_the_product() -> None:
    assert _listed() == _on_disk()


def test_the_wheel_lists_no_lab_and_no_tests() -> None:
    assert not [p for p in _listed() if "lab" in p.split(".") or p.startswith("tests")]
    assert not (REPO / "netproxy" / "lab").exists()
    with open(REPO / "lab" / "pyproject.toml", "rb") as f:
        assert tomllib is not None and tomllib.load(f)["tool"]["setuptools"]["packages"] == ["netproxy_lab"]
