"""The kernel seam of the nftables backend: one small protocol, one module per writer.

- :mod:`.netlink` (the default): nf_tables netlink batches built by :mod:`..encode`, no text;
- :mod:`.libnftables`: the nft text through the ``nftables`` binding (libnftables), the fallback
  and the oracle the netlink writer is tested against;
- :mod:`..fake`: an in-memory kernel with real semantics, for unit tests.

Every writer applies one transaction all or nothing and reads back only what the backend needs:
which tables exist, the ruleset generation, the contents of the affinity sets and maps, and (once,
at start) the stamps of restart by adoption.  Those are read over netlink by both writers
(:mod:`.readback`): libnftables would print and parse them as text again.
"""

from __future__ import annotations

from typing import AbstractSet, Dict, FrozenSet, List, Optional, Sequence, Tuple

try:  # Python 3.8+
    from typing import Protocol
except ImportError:  # pragma: no cover
    from typing_extensions import Protocol  # type: ignore[assignment]

from netproxy.backends.nftables.objects import Element, Set
from netproxy.backends.nftables.serialise import Op

WRITERS = ("netlink", "libnftables")


class Runner(Protocol):
    def apply(self, ops: Sequence[Op]) -> int:
        """Apply ``ops`` as one transaction; return the payload size; raise SyncError on refusal."""

    def existing_tables(self) -> FrozenSet[str]:
        """The families ("ip", "ip6") in which a ``netproxy`` table exists."""

    def read_sets(self, family: str) -> List[Tuple[Set, List[Element]]]:
        """The named sets (not maps) of ``family netproxy`` with their elements: the affinity state."""

    def read_elements(self, family: str, set_name: str) -> List[Element]:
        """The elements of one set or map of ``family netproxy`` (key, value, seconds left)."""

    def read_stamped(self, family: str, set_names: Sequence[str]) -> Dict[str, List[Element]]:
        """The elements, with their comments, of those of the named sets and maps of ``family
        netproxy`` that exist (restart by adoption: the small maps that carry stamps)."""

    def get_elements(self, family: str, set_name: str, keys: Sequence[str]) -> List[Element]:
        """Those of ``keys`` that one set or map of ``family netproxy`` holds, as elements (key,
        value, comment): a few elements of a large map, without reading it."""

    def chain_names(self, family: str) -> FrozenSet[str]:
        """The chains of ``family netproxy`` (empty without the table)."""

    def chain_uses(self, family: str) -> Dict[str, int]:
        """The chains of ``family netproxy`` with the kernel's use count of each: its rules plus the
        rules and verdict-map elements that jump or go to it (restart by adoption: whether a shared
        chain still has users, without reading the maps)."""

    def delete_tables(self) -> List[str]:
        """Delete netproxy's tables (and only them); return which were deleted."""

    def generation(self) -> Optional[int]:
        """The network namespace's nftables ruleset generation (bumped by every committed
        transaction, of any table, by anyone), or None when it cannot be read."""

    def watch(self, on: bool) -> None:
        """Start (or stop) listening to nftables change notifications (:mod:`monitor`)."""

    def probe(self) -> None:
        """Raise :class:`~netproxy.backends.base.BackendUnavailable` if this writer cannot run here."""

    def others_touched(self, own: AbstractSet[int]) -> Optional[bool]:
        """Whether a transaction not in ``own`` (generations) touched netproxy's tables since the
        last call; None when that cannot be known (not watching, notifications lost)."""


def create(writer: str) -> Runner:
    """The kernel writer called ``writer`` (one of :data:`WRITERS`), imported only when chosen."""
    if writer == "netlink":
        from netproxy.backends.nftables.kernel.netlink import NetlinkRunner

        netlink: Runner = NetlinkRunner()
        return netlink
    if writer == "libnftables":
        from netproxy.backends.nftables.kernel.libnftables import LibNftRunner

        text: Runner = LibNftRunner()
        return text
    from netproxy.backends.base import BackendUnavailable

    raise BackendUnavailable(f"unknown nftables writer {writer!r} (one of {', '.join(WRITERS)})")
