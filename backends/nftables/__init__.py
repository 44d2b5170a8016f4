"""The nftables backend (not implemented yet: every call says so, none pretends to succeed)."""

from __future__ import annotations

from netproxy.backends.base import BackendUnavailable, SyncResult
from netproxy.config import ProxyConfig
from netproxy.model import Changes, Snapshot


class NftablesBackend:
    name = "nftables"

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config

    def probe(self) -> None:
        raise BackendUnavailable("the nftables backend is not implemented yet")

    def plan(self, snapshot: Snapshot) -> str:
        raise BackendUnavailable("the nftables backend is not implemented yet")

    def sync(self, snapshot: Snapshot, changes: Changes) -> SyncResult:
        raise BackendUnavailable("the nftables backend is not implemented yet")

    def cleanup(self) -> None:
        raise BackendUnavailable("the nftables backend is not implemented yet")
