"""netproxy: a node service proxy (Kubernetes Services to iptables or nftables rules)."""

from __future__ import annotations

from importlib import metadata


def version() -> str:
    """netproxy's version: pyproject.toml's ``version``, the one source (the wheel's metadata, the
    image tag, the DaemonSets' ``image:`` are checked against it by tests/unit/test_version.py)."""
    try:
        return metadata.version("netproxy")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"
