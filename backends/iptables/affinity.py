"""ClientIP affinity on ipsets: which *slot* each endpoint of a service port takes (pure).

A client's endpoint is remembered as an element ``client, proto:port, service address`` of the set
``NETPROXY-AFFINITY-<family>-<slot>`` (``ipset.py``); the service's chain checks, for each endpoint,
the set of that endpoint's slot.  Sets are shared by all services, so their number is the largest
slot count, not the number of endpoints: a legacy table swap re-checks every ``-m set`` match in
O(1) (by set index), where every ``-m recent`` match looked its list up by name in a list of all
lists (README.md, "Where the time went").

A slot must stay with its endpoint while the endpoint stays, across syncs and across restarts of
netproxy, without any state: it is a hash of the endpoint's address and port modulo the slot count,
moved to the next free slot on a collision (endpoints taken in address order).  An endpoint that
joins or leaves moves another one only when they collided; an endpoint whose slot changes has its
clients released (they choose again), exactly like one that leaves.  The slot count grows with the
service (at least :data:`MIN_SLOTS`, at least twice its endpoints), so that collisions stay rare;
when it grows every slot of that service moves once.
"""

from __future__ import annotations

import zlib
from typing import Dict, Iterable, Tuple

MIN_SLOTS = 64
EndpointKey = Tuple[int, int]
"""(address as an integer, port)."""


def slot_count(endpoints: int) -> int:
    return max(MIN_SLOTS, 1 << max(0, 2 * endpoints - 1).bit_length())


def _preferred(key: EndpointKey, count: int) -> int:
    ip, port = key
    return zlib.crc32(ip.to_bytes(16, "big") + port.to_bytes(2, "big")) % count


def slots(endpoints: Iterable[EndpointKey]) -> Dict[EndpointKey, int]:
    """Endpoint → slot, the same for the same endpoints in any order and in any process."""
    keys = sorted(set(endpoints))
    count = slot_count(len(keys))
    taken: Dict[int, EndpointKey] = {}
    out: Dict[EndpointKey, int] = {}
    for key in keys:
        slot = _preferred(key, count)
        while slot in taken:
            slot = (slot + 1) % count
        taken[slot] = key
        out[key] = slot
    return out
