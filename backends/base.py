"""The interface every dataplane backend implements, and the errors it raises.

The core (``netproxy``) only ever talks to a :class:`Backend`; it never imports a concrete one.
A backend renders a :class:`~netproxy.core.model.Snapshot` into its desired state without I/O
(:meth:`Backend.plan`), and writes it in one atomic step (:meth:`Backend.sync`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet, List, Optional, Tuple

try:  # Python 3.8+: typing.Protocol; kept behind a name so that mypy sees one definition.
    from typing import Protocol
except ImportError:  # pragma: no cover
    from typing_extensions import Protocol  # type: ignore[assignment]

from netproxy.core.model import Changes, Snapshot


class BackendError(Exception):
    """Base of the errors a backend raises; ``kind`` is a short machine-readable word."""

    kind = "backend"

    def __init__(self, message: str, *, detail: Optional[str] = None) -> None:
        self.message = message
        self.detail = detail
        super().__init__(message if detail is None else f"{message}: {detail}")


class BackendUnavailable(BackendError):
    """The backend cannot run on this node (missing binary, library or kernel support)."""

    kind = "unavailable"


class SyncError(BackendError):
    """A kernel write failed; the previous ruleset is still in place.

    ``line`` is the failing payload line (or libnftables command) when the tool named one, so that
    logs show the rule that the kernel refused, not just "exit status 1".
    """

    kind = "sync"

    def __init__(self, message: str, *, line: Optional[str] = None, detail: Optional[str] = None,
                 payload: Optional[str] = None) -> None:
        self.line = line
        self.payload = payload
        text = message if line is None else f"{message} (failing line: {line!r})"
        super().__init__(text, detail=detail)


@dataclass(frozen=True)
class SyncResult:
    """What one sync did, for logs, metrics and the benchmark."""

    full: bool
    """Whether the backend rewrote everything it owns (as opposed to a partial/incremental write)."""
    services_written: int
    """How many service ports' objects were (re)written."""
    bytes_written: int = 0
    """Size of the payload handed to the kernel tool or library."""
    rules_owned: Tuple[Tuple[str, str, int], ...] = ()
    """(ip family "IPv4"/"IPv6", table, rules) this backend owns after the sync, for a backend that
    counts rules by table (iptables: kube-proxy's ``sync_proxy_rules_iptables_total{ip_family,table}``);
    empty when it does not."""
    rules_written: Tuple[Tuple[str, str, int], ...] = ()
    """(ip family, table, rules) written by this sync (``sync_proxy_rules_iptables_last{ip_family,table}``)."""


@dataclass(frozen=True)
class Packet:
    """The first packet of a connection, as a hook sees it (for tracers: ``netproxy trace``)."""

    saddr: str
    daddr: str
    dport: int
    proto: str = "tcp"
    sport: int = 40000
    hook: str = "prerouting"
    """``prerouting`` (from the network) or ``output`` (from the node itself)."""
    local: FrozenSet[str] = frozenset()
    """The node's own addresses (what ``fib ... type local`` / ``--dst-type LOCAL`` match)."""
    iif: str = ""
    """The interface it came in on (``-i`` / ``iifname``: --detect-local-mode's interface modes);
    empty for the node's own packets (``output``)."""

    @property
    def family(self) -> str:
        return "ip6" if ":" in self.daddr else "ip"


@dataclass(frozen=True)
class Outcome:
    """One way a traced packet can go: its verdict, its DNAT target, whether it is masqueraded, the
    chains it went through, and its share of the random choices on the way."""

    verdict: str
    """``dnat``, ``accept`` (untouched), ``allow`` (accepted by netproxy's own rule: the iptables
    backend's health-check NodePort), ``drop`` or ``reject``."""
    target: Optional[str] = None
    masquerade: bool = False
    chains: Tuple[str, ...] = ()
    share: float = 1.0


@dataclass(frozen=True)
class Held:
    """One proxy's rules that a dataplane (one iptables flavour, or nf_tables) holds on this node."""

    owner: str
    """``netproxy`` or ``kube-proxy``."""
    families: Tuple[int, ...] = ()
    marks: FrozenSet[str] = frozenset()
    """The masquerade marks its rules set (``0x4000``); empty when none could be read."""


class Backend(Protocol):
    """A dataplane: iptables (two writers), nftables, or the in-memory fake."""

    name: str

    def probe(self) -> None:
        """Check that the backend can run here; raise :class:`BackendUnavailable` saying why."""

    def plan(self, snapshot: Snapshot) -> str:
        """The full ruleset this backend would write for ``snapshot``, as text; touches nothing."""

    def sync(self, snapshot: Snapshot, changes: Changes) -> SyncResult:
        """Make the kernel match ``snapshot``; raise :class:`SyncError` leaving the old state on failure.

        ``changes`` is a hint: with ``changes.full`` everything the backend owns must end up matching
        ``snapshot`` (it may write less, or nothing, when its own check of the kernel shows its rules
        untouched since its last write); otherwise it may write only the named services (and whatever
        dispatches to them).
        """

    def cleanup(self) -> None:
        """Remove everything this backend created (the iptables backend: also the chains kube-proxy's old
        userspace mode left), and nothing else."""

    def missing_in_kernel(self) -> List[str]:
        """What of this backend's last full sync the kernel does not hold now, one line each (empty:
        all of it); ``netproxy migrate`` asks before it removes the old ruleset."""

    def halting(self) -> None:
        """``netproxy run`` was asked to stop, from another thread than its syncs': end any wait
        that only delays the stop (iptables: the xtables lock held by someone else); never raises."""

    def stopping(self) -> None:
        """``netproxy run`` stops (after its last sync): leave the kernel ready for the next process
        (nftables: re-stamp its tables, restart by adoption); never raises."""

    def tampered(self) -> Optional[str]:
        """Between syncs, cheaply: whether someone else changed or removed the rules this backend
        wrote since its last write, as a short reason (``netproxy_sync_proxy_rules_repairs_total``'s
        label), or None.  A reason also makes the next sync re-read the kernel and rewrite all."""
