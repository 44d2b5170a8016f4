"""The iptables tracer moved into the package (``netproxy.backends.iptables.trace``, used by
``netproxy trace``); this name stays for the unit tests that import it."""

from netproxy.backends.iptables.trace import Outcome, Packet, Tracer

__all__ = ["Outcome", "Packet", "Tracer"]
