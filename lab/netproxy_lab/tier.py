"""How much of the lab's suites a run covers: the quick tier (``make test``, CI) or the full one
(``make test-all``).

``NETPROXY_TIER`` chooses (default ``quick``, so that a bare ``pytest`` costs what ``make test``
costs).  The tier decides two things and nothing else:

- which backend/writer combinations a kernel or fault module runs (:func:`quick_combos`): the quick
  tier runs every traffic suite on each backend × iptables flavour with its default writer
  (:data:`DEFAULT_COMBOS`) and lets a module widen or narrow that with the ``quick_combos`` marker
  (the behavioural suite takes the fallback writers too; a fault takes fewer); the full tier runs
  every combination everywhere.  ``NETPROXY_BACKENDS``, when set, wins over both: the VM guests and
  people debugging one combination name theirs;
- the size of the fault suite's storms, outages and soaks (:func:`knob`): shorter in the quick tier,
  still measured and still printed as figures; the environment variable of each knob wins.
"""

from __future__ import annotations

import os
from typing import Sequence, Union

TIERS = ("quick", "full")

DEFAULT_COMBOS = ("nftables", "iptables-legacy/restore", "iptables-nft/restore")
"""Each backend × iptables flavour with the writer netproxy picks by default there (the nftables
netlink writer, iptables-restore on legacy and on iptables-nft).  The fallback writers (libiptc,
libnftables) are covered in the quick tier by their writer-equivalence tests and one behavioural
pass each."""


def tier() -> str:
    """The tier this run asked for; ValueError naming an unknown one."""
    name = os.environ.get("NETPROXY_TIER", "").strip() or "quick"
    if name not in TIERS:
        raise ValueError(f"NETPROXY_TIER={name!r}: one of {', '.join(TIERS)}")
    return name


def full() -> bool:
    return tier() == "full"


Number = Union[int, float]


def knob(env: str, *, quick: Number, full: Number) -> float:
    """A fault's size: ``env`` when set (a soak raises it), else the tier's value."""
    raw = os.environ.get(env, "").strip()
    if raw:
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{env}={raw!r} is not a number") from None
    return float(full if tier() == "full" else quick)


def quick_combos(marked: Sequence[str] = ()) -> str:
    """The combinations spec (as :func:`netproxy_lab.combos.parse` reads it) for a module in this
    run: ``NETPROXY_BACKENDS`` if set; every combination in the full tier; else the module's
    ``quick_combos`` marker, or :data:`DEFAULT_COMBOS`."""
    chosen = os.environ.get("NETPROXY_BACKENDS", "").strip()
    if chosen:
        return chosen
    if full():
        return "all"
    return ",".join(marked or DEFAULT_COMBOS)
