"""What a full sync writes: one policy for both backends (README.md, "When a sync skips the write").

Each backend gathers its own evidence that the kernel still holds what netproxy last wrote — the
iptables backend a fingerprint of its legacy tables taken right after its last full write
(``iptables/stamp.py``), the nftables backend the ruleset generation and the change notifications
(``nftables/monitor.py``) — and asks :meth:`SkipPolicy.decide` what a full sync does with it.  A
partial sync (changes the tracker named) is not decided here: it writes those changes.
"""

from __future__ import annotations

import enum
from typing import Callable, Optional


class Action(enum.Enum):
    REWRITE = "rewrite"
    """Re-read the kernel and write everything: repairs whatever anyone else changed."""
    WRITE_CHANGES = "write-changes"
    """Write only what differs from the record; when nothing differs, write nothing (a skip)."""


class SkipPolicy:
    """One backend's rule for its full syncs, and its count of full syncs that did not rewrite."""

    def __init__(self, bound: Optional[int] = None) -> None:
        self.bound = bound
        """Full syncs in a row that may go without a rewrite, for evidence with a race window (a
        change made in the instant between our write and the evidence would be taken for ours, and
        lives at most this many sync periods); None where there is none."""
        self.skipped = 0
        """Full syncs in a row that did not rewrite."""

    def decide(self, record: bool, vouched: Callable[[], Optional[bool]]) -> Action:
        """What a full sync does.

        ``record``: netproxy holds a trusted record of what it wrote.  ``vouched``: whether the kernel
        vouches that nobody else touched netproxy's tables since (True, False, or None: cannot tell),
        asked only when the answer depends on it: the evidence may cost a read of the kernel.  With
        WRITE_CHANGES the backend writes what differs from its record, or nothing."""
        bounded = self.bound is not None and self.skipped >= self.bound
        rewrite = not record or bounded or vouched() is not True
        action = Action.REWRITE if rewrite else Action.WRITE_CHANGES
        self.skipped = self.skipped + 1 if action is Action.WRITE_CHANGES else 0
        return action
