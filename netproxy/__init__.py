"""netproxy: a node service proxy (Kubernetes Services to iptables or nftables rules)."""

from __future__ import annotations


def version() -> str:
    """netproxy's version: pyproject.toml's ``version``, the one source (the wheel's metadata, the
    image tag, the DaemonSets' ``image:`` are checked against it by tests/unit/test_version.py)."""
    # Imported here: importlib.metadata took 45 ms of every command's start, and only --version,
    # run's build info and the z-pages ask.
    from importlib import metadata

    try:
        return metadata.version("netproxy")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "0+unknown"
