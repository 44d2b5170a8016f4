"""Dataplane backends, installed as ``netproxy.backends``.

The core asks :func:`create` for the backend the version check picked; concrete backends are
imported lazily so that a node without libnftables can still run the iptables backend, and the
other way round.
"""

from __future__ import annotations

from netproxy.backends.base import Backend, BackendError, BackendUnavailable, SyncError, SyncResult
from netproxy.backends.listing import Listing
from netproxy.core.config import ProxyConfig

__all__ = ["Backend", "BackendError", "BackendUnavailable", "SyncError", "SyncResult", "create", "listing"]


def create(name: str, config: ProxyConfig) -> Backend:
    """The backend called ``name`` ("iptables", "nftables" or "fake"), configured by ``config``."""
    if name == "iptables":
        from netproxy.backends.iptables import IptablesBackend

        return IptablesBackend(config)
    if name == "nftables":
        from netproxy.backends.nftables import NftablesBackend

        return NftablesBackend(config)
    if name == "fake":
        from netproxy.backends.fake import FakeBackend

        return FakeBackend(config)
    raise BackendUnavailable(f"unknown backend {name!r}")


def listing(name: str, config: ProxyConfig) -> Listing:
    """How backend ``name`` lists its objects in the kernel (``netproxy plan --diff``)."""
    if name == "iptables":
        from netproxy.backends.iptables.listing import IptablesListing

        return IptablesListing(config)
    if name == "nftables":
        from netproxy.backends.nftables.listing import NftablesListing

        return NftablesListing(config)
    raise BackendUnavailable(f"the {name} backend cannot list what the kernel holds")
