"""The conntrack sysctls kube-proxy sets at start (its pkg/proxy/conntrack/sysctls.go), from
``--conntrack-*`` or ``--config``'s ``conntrack`` section.

As kube-proxy does:
- ``nf_conntrack_max`` = max(maxPerCore × CPUs, min), capped at 1,048,576; only when maxPerCore > 0.
  When the hash table is smaller than a quarter of it, ``hashsize`` is raised too.
- the TCP established / close-wait timeouts, tcp_be_liberal, the UDP timeouts: only when given
  (a zero or absent value leaves the kernel's).
- a value already in place is not written; a write that fails stops the start, naming the sysctl
  and the setting it came from.

Inside a network namespace (a container with its own netns, the kernel tests) the timeouts and
tcp_be_liberal are the namespace's own, but ``nf_conntrack_max`` is read-only and ``hashsize`` is a
module parameter the kernel lets only the initial namespace change: asking for a different value
there fails as it fails for kube-proxy ("set conntrack.maxPerCore to 0", as kind does).

netproxy differs in one way: kube-proxy fills unset fields with its defaults (maxPerCore 32768,
min 131072, 24h established, 1h close-wait); netproxy changes nothing it was not asked to, so that
running it never rewrites the node's conntrack settings by surprise (docs/parity.md).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

log = logging.getLogger(__name__)

MAX_LIMIT = 1_048_576
PROC = "/proc/sys/net/netfilter"
HASHSIZE = "/sys/module/nf_conntrack/parameters/hashsize"


class SysctlError(RuntimeError):
    """A conntrack setting could not be applied (names the sysctl and the setting)."""


@dataclass(frozen=True)
class ConntrackSettings:
    """kube-proxy's KubeProxyConntrackConfiguration; None/0 = leave the kernel's value."""

    max_per_core: Optional[int] = None
    min: Optional[int] = None
    tcp_established_timeout: Optional[float] = None
    tcp_close_wait_timeout: Optional[float] = None
    tcp_be_liberal: bool = False
    udp_timeout: Optional[float] = None
    udp_stream_timeout: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("max_per_core", "min", "tcp_established_timeout", "tcp_close_wait_timeout", "udp_timeout",
                     "udp_stream_timeout"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"conntrack {name.replace('_', '-')}: {value} is negative")


def conntrack_max(settings: ConntrackSettings, cpus: int) -> int:
    """kube-proxy's getConntrackMax: 0 = do not set."""
    if not settings.max_per_core:
        return 0
    scaled = settings.max_per_core * cpus
    if scaled > MAX_LIMIT:
        return MAX_LIMIT
    return max(scaled, settings.min or 0)


def plan(settings: ConntrackSettings, cpus: int) -> List[Tuple[str, int, str]]:
    """(sysctl under net/netfilter, value, the setting it comes from), in kube-proxy's order."""
    out: List[Tuple[str, int, str]] = []
    limit = conntrack_max(settings, cpus)
    if limit:
        out.append(("nf_conntrack_max", limit, "conntrack.maxPerCore/min"))
    for name, value, source in (
            ("nf_conntrack_tcp_timeout_established", settings.tcp_established_timeout,
             "conntrack.tcpEstablishedTimeout"),
            ("nf_conntrack_tcp_timeout_close_wait", settings.tcp_close_wait_timeout, "conntrack.tcpCloseWaitTimeout")):
        if value:
            out.append((name, int(value), source))
    if settings.tcp_be_liberal:
        out.append(("nf_conntrack_tcp_be_liberal", 1, "conntrack.tcpBeLiberal"))
    for name, value, source in (("nf_conntrack_udp_timeout", settings.udp_timeout, "conntrack.udpTimeout"),
                                ("nf_conntrack_udp_timeout_stream", settings.udp_stream_timeout,
                                 "conntrack.udpStreamTimeout")):
        if value:
            out.append((name, int(value), source))
    return out


def cpu_count() -> int:
    """CPUs as kube-proxy counts them (all of the machine's, not this process's affinity)."""
    return os.cpu_count() or 1


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _write_int(path: str, value: int) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def apply(settings: ConntrackSettings, *, cpus: Optional[int] = None, proc: str = PROC, hashsize: str = HASHSIZE,
          read: Callable[[str], Optional[int]] = _read_int, write: Callable[[str, int], None] = _write_int) -> int:
    """Set the sysctls ``settings`` ask for, in the caller's network namespace; the number written.
    Raises SysctlError on the first that cannot be set."""
    written = 0
    for name, value, source in plan(settings, cpus or cpu_count()):
        path = os.path.join(proc, name)
        current = read(path)
        if current == value:
            log.info("conntrack: %s is already %d (%s)", name, value, source)
        else:
            log.info("conntrack: setting %s to %d (was %s; %s)", name, value, current, source)
            try:
                write(path, value)
            except OSError as err:
                raise SysctlError(f"cannot set net.netfilter.{name} to {value} (from {source}): {err.strerror or err}"
                                  + ("; inside a network namespace it is read-only: set conntrack.maxPerCore "
                                     "to 0 to leave it" if name == "nf_conntrack_max" else "")) from None
            written += 1
        if name == "nf_conntrack_max":
            buckets = read(hashsize)
            if buckets is not None and buckets < value // 4:
                log.info("conntrack: setting hashsize to %d (was %d)", value // 4, buckets)
                try:
                    write(hashsize, value // 4)
                except OSError as err:
                    raise SysctlError(f"cannot set the conntrack hashsize to {value // 4} (for nf_conntrack_max "
                                      f"{value}, from {source}): {err.strerror or err}") from None
                written += 1
    return written
