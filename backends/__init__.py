"""Dataplane backends, installed as ``netproxy.backends``.

The core asks :func:`create` for the backend the version check picked; concrete backends are
imported lazily so that a node without libnftables can still run the iptables backend, and the
other way round.
"""

from __future__ import annotations

from typing import List

from netproxy.backends.base import Backend, BackendError, BackendUnavailable, Held, SyncError, SyncResult
from netproxy.backends.listing import Listing
from netproxy.core.config import ProxyConfig

__all__ = ["Backend", "BackendError", "BackendUnavailable", "Held", "SyncError", "SyncResult", "create", "held",
           "listing", "remove_kube_proxy", "remove_rules_only"]


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


# -- what a dataplane holds on this node, and removing it: for ``netproxy detect`` and ``migrate``,
# which know no backend's internals (make lint's layer contract) ---------------------------------


def held(dataplane: str, flavour: str = "", marks: bool = True) -> List[Held]:
    """netproxy's and kube-proxy's rules that ``dataplane`` (``iptables`` of one ``flavour``, or
    ``nftables``) holds now, read without writing; ``marks``: read their masquerade marks (iptables
    always does).  BackendError (or OSError) when the dataplane cannot be read."""
    if dataplane == "iptables":
        from netproxy.backends.iptables import holdings as ipt

        found = ipt.held(flavour)
        return [found] if found is not None else []
    from netproxy.backends.nftables import holdings as nft

    tables: List[Held] = nft.held(marks)
    return tables


def remove_kube_proxy(dataplane: str, flavour: str, target: Backend) -> None:
    """Remove kube-proxy's rules from ``dataplane``; ``target`` is the backend that now serves (an
    iptables target on the same flavour keeps the chains its full sync took over)."""
    if dataplane == "iptables":
        from netproxy.backends.iptables import holdings as ipt

        ipt.remove_kube_proxy(flavour, target)
        return
    from netproxy.backends.nftables import holdings as nft

    nft.remove_kube_proxy()


def remove_rules_only(flavour: str) -> None:
    """Remove netproxy's iptables rules of ``flavour`` but not its ipsets (the kernel's, not a
    flavour's: an iptables backend on the other flavour uses them)."""
    from netproxy.backends.iptables import holdings as ipt

    ipt.remove_rules(flavour)
