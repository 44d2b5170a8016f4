"""The kernel seam of the iptables backend: one small protocol, one module per writer.

- :mod:`.restore` (the default): ``iptables-{legacy,nft}-restore --noflush``, fed the restore text
  of :mod:`..payload`;
- :mod:`.libiptc`: libiptc in process through python-iptables (legacy tables only);
- :mod:`.stamp`: the legacy tables' blob read directly (chain names, built-in jumps, fingerprints),
  which both writers use to read the kernel;
- :mod:`..fake`: an in-memory kernel that parses the restore text, for unit tests.

Every writer applies each table's changes all or nothing and reads back only what the backend
needs: chain names and built-in jumps (a full sync), a fingerprint (skip an untouched full sync),
rule counts (``guard``: changed behind our back?), and the tables as text (``cleanup``).
"""

from __future__ import annotations

from typing import AbstractSet, Callable, Dict, List, Optional, Sequence, Set, Tuple

try:  # Python 3.8+
    from typing import Protocol
except ImportError:  # pragma: no cover
    from typing_extensions import Protocol  # type: ignore[assignment]

from netproxy.backends.iptables.diff import KernelTable, TableChange
from netproxy.backends.iptables.kernel.stamp import Expected, Stamp
from netproxy.backends.iptables.xtlock import XtablesLock

WRITERS = ("restore", "libiptc")

Counts = Tuple[Optional[Dict[str, int]], Set[Tuple[str, str]]]
"""One table's chains with their rule counts (None: the table is gone) and its built-in jumps."""


class Text(Protocol):
    """A family's tables as ``iptables-save`` text, and a restore payload applied to them
    (``netproxy cleanup``, ``netproxy migrate``)."""

    def save(self, family: int, table: str) -> str:
        """``iptables-save -t table`` of ``family``; SyncError when it cannot be read."""

    def restore(self, family: int, payload: str) -> None:
        """``iptables-restore --noflush`` of ``payload``; SyncError (naming the line) on refusal."""


class Writer(Text, Protocol):
    """What the backend asks of the kernel, whichever writer is configured."""

    name: str

    def probe(self) -> None:
        """Raise :class:`~netproxy.backends.base.BackendUnavailable` if this writer cannot run here."""

    def read(self, family: int, fingerprint: bool = False) -> Dict[str, KernelTable]:
        """Per table: its chains and which built-in chains jump to which (a full sync's read); with
        ``fingerprint``, on legacy tables, each table's fingerprint and header from the same read."""

    def header(self, family: int, table: str) -> Optional[bytes]:
        """A legacy table's header now (``IPT_SO_GET_INFO``: changes with any write; None when there is
        none to read), to compare with :meth:`read`'s."""

    def apply(self, family: int, changes: List[TableChange],
              before_commit: Optional[Callable[[], None]] = None,
              meanwhile: Optional[Callable[[], None]] = None) -> int:
        """Write ``changes``, each table all or nothing; ``before_commit`` is called once, before the
        first table is committed (the ipsets the new rules need are being filled meanwhile,
        ``sets.py``); ``meanwhile`` once, after the last of the payload is handed over and while the
        kernel commits it if the writer can wait for that elsewhere (the restore tool's commit),
        else after the write; it must not raise.  Returns the bytes written."""

    def stamp(self, families: Sequence[int], expect: Optional[Expected] = None) -> Optional[Stamp]:
        """A value that changes whenever anyone changes these families' tables (None: cannot tell
        here, or the tables do not hold ``expect``'s chains with those rule counts — then nothing is
        skipped); see :mod:`.stamp`."""

    def counts(self, family: int, table: str) -> Counts:
        """The table's chains with their rule counts and its built-in jumps, read now (``guard``)."""

    def own_pids(self) -> AbstractSet[int]:
        """Processes other than this one whose nf_tables commits are ours (the restore tools)."""


def create(writer: str, flavour: str, lock: XtablesLock, keep_text: bool = True) -> Writer:
    """The kernel writer called ``writer`` (one of :data:`WRITERS`) for iptables ``flavour``
    ("legacy" or "nft"), imported only when chosen; ``keep_text``: keep each chain's restore text
    for the next write (a long-running proxy), not for one sync."""
    if writer == "libiptc":
        from netproxy.backends.iptables.kernel.libiptc import LibiptcWriter

        libiptc: Writer = LibiptcWriter(flavour, lock)
        return libiptc
    if writer == "restore":
        from netproxy.backends.iptables.kernel.restore import RestoreWriter

        restore: Writer = RestoreWriter(flavour, keep_text=keep_text, lock=lock)
        return restore
    from netproxy.backends.base import BackendUnavailable

    raise BackendUnavailable(f"unknown iptables writer {writer!r} (one of {', '.join(WRITERS)})")


def saved_counts(text: Text, family: int, table: str) -> Counts:
    """:meth:`Writer.counts` from ``iptables-save`` (iptables-nft, whose tables have no blob)."""
    from netproxy.backends.iptables import save

    parsed = save.parse(text.save(family, table))
    if table not in parsed:
        return None, set()
    saved = parsed[table]
    return {c.name: len(c.rules) for c in saved.chains.values()}, set(saved.kernel_table().jumps)


def legacy_header(family: int, table: str) -> Optional[bytes]:
    """:meth:`Writer.header` of a legacy table (None: it cannot be read)."""
    from netproxy.backends.iptables import guard

    try:
        return guard.table_info(family, table)
    except OSError:
        return None


def blob_counts(family: int, table: str) -> Counts:
    """:meth:`Writer.counts` from the legacy table's blob (one ``getsockopt``)."""
    from netproxy.backends.iptables import guard

    counts, jumps = guard.legacy_counts(family, table)
    return dict(counts), set(jumps)
