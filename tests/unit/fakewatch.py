"""A stand-in for the iptables guard's watch (``guard.LegacyWatch`` / ``NftWatch``) in unit tests: the
real ones read the host's tables or subscribe to its nftables notifications."""

from __future__ import annotations


class FakeWatch:
    """Suspects a foreign write when a test sets :attr:`dirty`; each rebase (after our own writes,
    and after a look that suspected) clears it."""

    def __init__(self) -> None:
        self.dirty = False
        self.rebases = 0

    def suspect(self) -> bool:
        return self.dirty

    def rebase(self) -> None:
        self.rebases += 1
        self.dirty = False

    def pause(self) -> None:
        return None

    def resume(self, commits: int) -> None:
        return None

    def close(self) -> None:
        return None
