"""The iptables tracer moved into the package (``netproxy.backends.iptables.trace``, used by
``netproxy trace``); this name stays for the unit tests that import it, with their short way of
writing an outcome."""

from typing import Optional

from netproxy.backends import base
from netproxy.backends.iptables.trace import Packet, Tracer

__all__ = ["Outcome", "Packet", "Tracer"]


def Outcome(verdict: str, endpoint: Optional[str] = None, masqueraded: bool = False) -> base.Outcome:
    """What :meth:`Tracer.trace` returns for a packet that ends ``verdict`` ("accept", "drop",
    "reject"), DNAT-ed to ``endpoint`` (then its verdict is "dnat") or not, masqueraded or not."""
    return base.Outcome("dnat" if endpoint and verdict == "accept" else verdict, endpoint, masqueraded)
