"""The ``service-cidrs`` set against the fake kernel: filled from ``Snapshot.service_cidrs``, kept in
step by incremental syncs (overlaps merged, per family), and equal to what a fresh sync writes."""

from __future__ import annotations

import dataclasses
import ipaddress

from netproxy.backends.nftables import names
from netproxy.core.model import Changes, Snapshot
from tests.unit.nftables.nft_helpers import backend, dumps, eps, fresh_dumps, snap, svc

net = ipaddress.ip_network


def with_cidrs(s: Snapshot, *cidrs: str) -> Snapshot:
    return dataclasses.replace(s, service_cidrs=tuple(net(c) for c in cidrs))


def test_service_cidrs_follow_the_snapshot_incrementally() -> None:
    b, fake = backend()
    web = svc("web", "10.96.0.10")
    base = snap((web, eps("10.1.0.1")), (svc("v6", "fd00::10"), eps("fd01::1")))
    b.sync(with_cidrs(base, "10.96.0.0/16", "fd00::/108"), Changes())
    assert set(fake.elements("ip", names.SERVICE_CIDRS)) == {"10.96.0.0/16"}
    assert set(fake.elements("ip6", names.SERVICE_CIDRS)) == {"fd00::/108"}
    # A second ServiceCIDR, one inside the first (merged), and the IPv6 one gone: a state that an
    # incremental sync must reach exactly as a fresh one would.
    later = with_cidrs(base, "10.96.0.0/16", "10.96.8.0/24", "10.100.0.0/24")
    b.sync(later, Changes(full=False))
    assert set(fake.elements("ip", names.SERVICE_CIDRS)) == {"10.96.0.0/16", "10.100.0.0/24"}
    assert fake.elements("ip6", names.SERVICE_CIDRS) == {}
    assert dumps(fake) == fresh_dumps(later)
    b.sync(with_cidrs(base), Changes(full=True))
    assert fake.elements("ip", names.SERVICE_CIDRS) == {}


def test_the_drop_follows_the_cluster_ip_reject_in_forward_and_output_only() -> None:
    b, fake = backend()
    b.sync(with_cidrs(snap((svc("web", "10.96.0.10"), eps("10.1.0.1"))), "10.96.0.0/16"), Changes())
    drop = "ct state new ip daddr @service-cidrs drop"
    for chain in (names.FILTER_FORWARD, names.FILTER_OUTPUT):
        assert fake.chain_rules("ip", chain)[-2:] == ["ct state new ip daddr @cluster-ips reject", drop]
    assert drop not in fake.chain_rules("ip", names.FILTER_INPUT)
