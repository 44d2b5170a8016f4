"""IPv6 ClientIP affinity in its two layouts, rendered by the same code: the shared
``affinity-<proto>`` maps' elements (``ProxyConfig.ipv6_affinity == "maps"``, chosen where the node's
nft is 1.1 or later) and one set per endpoint ("sets", the layout nft 1.0.x lists back).  Which one a
node gets is netproxy/node/detect.py's (tests/unit/test_detect.py); that the chosen one re-loads with
the node's own ``nft -f`` is tests/kernel/test_behaviour.py's, on the host and in the VM guests."""

from __future__ import annotations

import dataclasses
from typing import Dict

import pytest

from netproxy.backends.base import Packet
from netproxy.backends.nftables import expr, names
from netproxy.backends.nftables.trace import Tracer
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Changes, Snapshot
from tests.unit.nftables.nft_helpers import backend, eps, fresh_dumps, snap, svc

MAPS = ProxyConfig(hostname="node-a", ipv6_affinity="maps")
SETS = ProxyConfig(hostname="node-a", ipv6_affinity="sets")
AFF = names.affinity_map("tcp")
STICKY6 = svc("s", "fd00::20", affinity=True, timeout=42)
STICKY4 = svc("s4", "10.96.0.20", affinity=True, timeout=42)


def _cluster() -> Snapshot:
    return snap((STICKY6, eps("fd01::4", "fd01::5", "fd01::6")), (STICKY4, eps("10.1.0.4", "10.1.0.5")))


def test_the_maps_layout_is_ipv4s_shape_in_the_ip6_table() -> None:
    b, fake = backend(MAPS)
    b.sync(_cluster(), Changes())
    assert fake.elements("ip6", names.SERVICE_IPS) == {"fd00::20 . tcp . 80": "goto cluster-tcp-sticky-pick-3"}
    assert fake.chain_rules("ip6", "cluster-tcp-sticky-pick-3") == [
        "meta l4proto tcp dnat ip6 to ip6 saddr . ip6 daddr . th dport map @affinity-tcp",
        "meta l4proto tcp dnat ip6 to ip6 daddr . th dport . numgen random mod 3 map @cluster-tcp-sticky-endpoints-3"]
    assert fake.elements("ip6", names.AFFINITY_SERVICES) == {"fd00::20 . tcp . 80": "goto affinity-tcp-42"}
    assert fake.chain_rules("ip6", "affinity-tcp-42") == [
        "meta l4proto tcp update @affinity-tcp { ip6 saddr . ct original ip6 daddr . ct original proto-dst "
        "timeout 42s : ip6 daddr . ct reply proto-src }"]
    amap = fake.tables["ip6"].sets[AFF]
    assert (amap.key_type, amap.value_type) == ("ipv6_addr . ipv6_addr . inet_service", "ipv6_addr . inet_service")
    assert set(amap.flags) == {"dynamic", "timeout"}
    assert any("ct original ip6 daddr" in r and "vmap @affinity-services" in r
               for r in fake.chain_rules("ip6", "affinity-prerouting"))
    assert not [n for n in fake.tables["ip6"].sets if n.startswith("aff-")], "no set per endpoint"
    assert not [c for c in fake.tables["ip6"].chains if c.startswith(("svc-", "ext-", "all-"))], "no chain per port"


def test_the_sets_layout_keeps_a_set_per_endpoint_and_no_shared_map() -> None:
    b, fake = backend(SETS)
    b.sync(_cluster(), Changes())
    assert fake.elements("ip6", names.SERVICE_IPS) == {"fd00::20 . tcp . 80": "goto svc-ns/s/http"}
    assert sorted(n for n in fake.tables["ip6"].sets if n.startswith("aff-")) == [
        f"aff-ns/s/http-fd01__{i}-8080" for i in (4, 5, 6)]
    assert AFF not in fake.tables["ip6"].sets and names.AFFINITY_SERVICES not in fake.tables["ip6"].sets
    assert "affinity-prerouting" not in fake.tables["ip6"].chains


def test_the_ipv4_table_is_the_same_in_either_layout() -> None:
    assert fresh_dumps(_cluster(), MAPS)["ip"] == fresh_dumps(_cluster(), SETS)["ip"]
    assert fresh_dumps(_cluster(), MAPS)["ip6"] != fresh_dumps(_cluster(), SETS)["ip6"]


def test_the_default_is_the_layout_every_nft_lists_back() -> None:
    assert ProxyConfig().ipv6_affinity == "sets"


def test_an_endpoint_that_leaves_releases_its_ipv6_clients_in_the_same_transaction() -> None:
    b, fake = backend(MAPS)
    b.sync(_cluster(), Changes())
    fake.touch("ip6", AFF, "fd00:1::5 . fd00::20 . 80", expires=30, value="fd01::4 . 8080")
    fake.touch("ip6", AFF, "fd00:1::6 . fd00::20 . 80", expires=30, value="fd01::5 . 8080")
    after = _cluster()
    after.endpoints[STICKY6.name] = eps("fd01::5", "fd01::6")  # type: ignore[index]
    b.sync(after, Changes(full=False, services=frozenset({STICKY6.name})))
    assert set(fake.tables["ip6"].elements[AFF]) == {"fd00:1::6 . fd00::20 . 80"}
    assert b.last_transaction is not None
    assert "delete element ip6 netproxy affinity-tcp { fd00:1::5 . fd00::20 . 80 }" in str(b.last_transaction)


def test_a_full_rewrite_keeps_the_ipv6_clients_of_endpoints_still_eligible() -> None:
    b, fake = backend(MAPS)
    b.sync(_cluster(), Changes())
    fake.touch("ip6", AFF, "fd00:1::5 . fd00::20 . 80", expires=37, value="fd01::6 . 8080")
    fake.touch("ip6", AFF, "fd00:1::7 . fd00::20 . 80", expires=20, value="fd01::9 . 8080")  # not an endpoint
    fake.foreign_write()  # someone else's transaction: the full sync rebuilds the tables
    b.sync(_cluster(), Changes())
    kept = fake.tables["ip6"].elements[AFF]
    assert {k: (e.value, e.expires) for k, e in kept.items()} == {"fd00:1::5 . fd00::20 . 80": ("fd01::6 . 8080", 37)}


@pytest.mark.parametrize("config", [MAPS, SETS], ids=["maps", "sets"])
def test_the_tracer_sends_a_new_ipv6_client_to_every_endpoint_alike(config: ProxyConfig) -> None:
    b, fake = backend(config)
    b.sync(_cluster(), Changes())
    assert _shares(Tracer(fake, "ip6"), "fd00:1::9") == {f"[fd01::{i}]:8080": 0.333 for i in (4, 5, 6)}


def test_the_tracer_sends_a_remembered_ipv6_client_to_its_endpoint_only() -> None:
    b, fake = backend(MAPS)
    b.sync(_cluster(), Changes())
    fake.touch("ip6", AFF, "fd00:1::5 . fd00::20 . 80", 60, "fd01::5 . 8080")
    assert _shares(Tracer(fake, "ip6"), "fd00:1::5") == {"[fd01::5]:8080": 1.0}


def _shares(tracer: Tracer, client: str) -> Dict[str, float]:
    """Each DNAT target's share of a new connection from ``client`` to the sticky service."""
    out: Dict[str, float] = {}
    for o in tracer.trace(Packet(client, "fd00::20", 80)):
        out[str(o.target)] = out.get(str(o.target), 0.0) + o.share
    return {t: round(s, 3) for t, s in out.items()}


def test_every_ipv6_affinity_expression_decodes_back_from_its_netlink_form() -> None:
    """What the netlink writer sends for the maps layout is what ``trace --kernel`` reads back."""
    b, fake = backend(dataclasses.replace(MAPS, masquerade_all=True))
    nodeport = dataclasses.replace(svc("np", "fd00::30", affinity=True, timeout=60), node_port=30080)
    b.sync(snap((STICKY6, eps("fd01::4", "fd01::5")), (nodeport, eps("fd01::7"))), Changes())
    rules = [r for chain in fake.tables["ip6"].rules.values() for r in chain]
    assert any("update @affinity-tcp" in r.body for r in rules)
    for rule in rules:
        encoded = b"".join(e.encode() for e in rule.exprs)
        assert expr.decode_rule(encoded) == tuple(rule.exprs), rule.body
