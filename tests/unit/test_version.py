"""One version: pyproject.toml's, which the wheel carries, ``netproxy --version`` prints, ``run``'s
start-up line names and the DaemonSets' image tags repeat."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import netproxy

REPO = Path(__file__).resolve().parents[2]


def project_version() -> str:
    found = re.search(r'^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text(), re.M)
    assert found, "pyproject.toml has no version"
    return found.group(1)


def test_version_flag_prints_the_projects_version() -> None:
    proc = subprocess.run([sys.executable, "-m", "netproxy", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"netproxy {project_version()}"
    assert netproxy.version() == project_version()


def test_the_daemonsets_name_the_image_of_this_version() -> None:
    for name in ("daemonset.yaml", "daemonset-kubeadm.yaml"):
        images = re.findall(r"image: (\S+)", (REPO / "deploy" / name).read_text())
        assert images and set(images) == {f"localhost/netproxy:{project_version()}"}, (name, images)


def test_make_image_tags_the_image_with_this_version() -> None:
    """`make image` builds the tag the DaemonSets name (scripts/build-image reads pyproject.toml)."""
    proc = subprocess.run([str(REPO / "scripts" / "build-image"), "--print-tag"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"localhost/netproxy:{project_version()}"


def test_the_docs_name_the_image_of_this_version() -> None:
    """Every netproxy:X.Y.Z the install instructions show is this version, so that a release bump
    that forgets one fails here."""
    for path in (REPO / "README.md", REPO / "deploy" / "README.md", REPO / "deploy" / "Containerfile"):
        tags = re.findall(r"netproxy:(\d+\.\d+\.\d+)", path.read_text())
        assert set(tags) <= {project_version()}, (path.name, tags)
