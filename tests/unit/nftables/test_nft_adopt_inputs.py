"""Restart by adoption from the stamps of the inputs (layout 3): a new process compares each service
port's stamp, a digest of what it is rendered from, before rendering anything, and renders only the
ports whose stamps differ (adopt.py, stamp.py)."""

from __future__ import annotations

import dataclasses
import inspect
import ipaddress
import logging
from typing import Dict, List, Sequence

import pytest

from netproxy.backends.nftables import FakeNft, NftablesBackend, adopt, names, render, stamp
from netproxy.backends.nftables.objects import Element
from netproxy.core.config import ProxyConfig, parse_cidrs
from netproxy.core.model import Changes, Endpoint, NodeInfo, ServicePort, Snapshot
from tests.unit.nftables.nft_helpers import dumps, eps, fresh_dumps, snap, svc

CONFIG = ProxyConfig(hostname="node-a", cluster_cidrs=parse_cidrs("10.244.0.0/16"))
ONE_SHOT = dataclasses.replace(CONFIG, one_shot=True)
WEB = svc("web", "10.96.0.10", external=["192.0.2.10"])
API = svc("api", "10.96.0.11")
DNS = svc("dns", "10.96.0.53", 53, proto="UDP", port_name="dns")
V6 = svc("v6", "fd00::10")


def _base() -> Snapshot:
    return snap((WEB, eps("10.1.0.1", "10.1.0.2", "10.1.0.3")), (API, eps("10.1.1.1", "10.1.1.2", "10.1.1.3")),
                (DNS, eps("10.1.2.1", port=53)), (V6, eps("fd01::1", "fd01::2")), node="node-a")


def _written(snapshot: Snapshot, config: ProxyConfig = CONFIG) -> FakeNft:
    fake = FakeNft()
    NftablesBackend(config, kernel=fake).sync(snapshot, Changes())
    return fake


def _counting_renders(monkeypatch: pytest.MonkeyPatch) -> List[str]:
    rendered: List[str] = []
    real = render.render_service

    def counted(svc: ServicePort, *args: object, **kwargs: object) -> render.ServiceObjects:
        rendered.append(str(svc.name))
        return real(svc, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(render, "render_service", counted)
    return rendered


def _read_sets(monkeypatch: pytest.MonkeyPatch, fake: FakeNft) -> List[str]:
    read: List[str] = []
    real = fake.read_stamped

    def recorded(family: str, set_names: Sequence[str]) -> Dict[str, List[Element]]:
        read.extend(set_names)
        return real(family, set_names)

    monkeypatch.setattr(fake, "read_stamped", recorded)
    return read


def test_a_one_shot_restart_renders_only_the_changed_port_and_reads_no_dispatch_map(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _written(_base())
    later = _base()
    later.endpoints[API.name] = eps("10.1.1.1", "10.1.1.9", "10.1.1.3")  # type: ignore[index]
    rendered = _counting_renders(monkeypatch)
    read = _read_sets(monkeypatch, fake)
    b = NftablesBackend(ONE_SHOT, kernel=fake)
    assert b.sync(later, Changes()).services_written == 1
    assert rendered == [str(API.name)], rendered
    # its old elements asked for by key: the per-service maps are not read whole
    assert names.SERVICE_IPS not in read and set(names.SERVICE_STAMP_SETS) <= set(read), read
    assert dumps(fake) == fresh_dumps(later, CONFIG)
    # nothing changed: nothing rendered, nothing written
    rendered.clear()
    before = len(fake.transactions)
    assert NftablesBackend(ONE_SHOT, kernel=fake).sync(later, Changes()).services_written == 0
    assert rendered == [] and len(fake.transactions) == before


def test_a_one_shot_backend_keeps_no_record_so_its_next_sync_starts_over() -> None:
    """A one-shot sync that adopted holds no record of the ports it did not render: were it ever to
    sync again, that sync rewrites from nothing rather than going on from a partial record."""
    fake = _written(_base())
    b = NftablesBackend(ONE_SHOT, kernel=fake)
    b.sync(_base(), Changes())
    assert b.written_tables() == frozenset({"ip", "ip6"})
    later = _base()
    later.endpoints[API.name] = eps("10.1.1.9")  # type: ignore[index]
    b.sync(later, Changes(full=False, services=frozenset({API.name})))
    assert dumps(fake) == fresh_dumps(later, CONFIG)


def test_run_renders_its_whole_record_after_adopting() -> None:
    fake = _written(_base())
    b = NftablesBackend(CONFIG, kernel=fake)
    b.sync(_base(), Changes())
    state = b._state
    assert state is not None and set(state.entries) == set(_base().services)
    assert b._state is not None and not b._partial


def test_the_stamps_a_new_process_computes_are_the_ones_a_full_sync_writes() -> None:
    """adopt.wanted (no render) and a full sync (render, then claim) agree on every port, the keys a
    port loses to another included: two ports share a cluster IP and port, two a NodePort."""
    a = dataclasses.replace(svc("a", "10.96.0.40"), node_port=30080)
    b = dataclasses.replace(svc("b", "10.96.0.40", port_name="other"), node_port=30080)
    c = dataclasses.replace(svc("c", "10.96.0.41", external=["10.96.0.40"]), node_port=30081)
    dual = dataclasses.replace(svc("dual", "10.96.0.50"), cluster_ips=(ipaddress.ip_address("10.96.0.50"),
                                                                    ipaddress.ip_address("fd00::50")))
    s = snap((a, eps("10.1.0.1")), (b, eps("10.1.0.2")), (c, ()), (dual, eps("10.1.0.5", "fd01::5")),
             *[(x, _base().endpoints[x.name]) for x in _base().services.values()], node="node-a")
    fake = _written(s)
    wants = adopt.wanted(s)
    assert wants["ip"]["ns/b:other"].taken == ("10.96.0.40 . tcp . 80", "tcp . 30080")
    assert wants["ip"]["ns/c:http"].taken == ("10.96.0.40 . tcp . 80",)  # its external IP is a's cluster IP
    for fam in ("ip", "ip6"):
        kernel = {(e.comment or "").split(" d:")[0]: (e.comment or "").split(" d:")[1][:16]
                  for where in names.SERVICE_STAMP_SETS for e in fake.tables[fam].elements[where].values()}
        assert kernel == {base: w.digest for base, w in wants[fam].items()}, fam


def test_a_key_another_port_gave_up_is_taken_over_at_a_restart() -> None:
    """Port b lost its cluster IP and NodePort keys to a (first in name order); a is deleted before
    the restart: b's inputs are the same, but its stamp (which names the keys it lost) is not, so it
    is rendered and gets them."""
    a = dataclasses.replace(svc("a", "10.96.0.40"), node_port=30080)
    b = dataclasses.replace(svc("b", "10.96.0.40", port_name="other"), node_port=30080)
    fake = _written(snap((a, eps("10.1.0.1")), (b, eps("10.1.0.2")), node="node-a"))
    assert "ns/b:other" not in str(fake.tables["ip"].elements[names.SERVICE_IPS])
    later = snap((b, eps("10.1.0.2")), node="node-a")
    NftablesBackend(ONE_SHOT, kernel=fake).sync(later, Changes())
    assert dumps(fake) == fresh_dumps(later, CONFIG)


@pytest.mark.parametrize("one_shot", [True, False], ids=["sync", "run"])
def test_shared_elements_an_unchanged_port_needs_stay(one_shot: bool) -> None:
    """A cluster IP two ports of one service share, an endpoint two services share on this node: one
    port changes so that it no longer needs them, the other (not rendered) still does."""
    http = svc("multi", "10.96.0.70", 80)
    https = svc("multi", "10.96.0.70", 443, port_name="https")
    other = svc("other", "10.96.0.71")
    here = eps("10.1.7.1", "10.1.7.2", node="node-a")
    base = snap((http, here), (https, here), (other, eps("10.1.7.1", node="node-a")), node="node-a")
    fake = _written(base)
    assert "10.1.7.1 . 10.1.7.1" in fake.tables["ip"].elements[names.HAIRPIN]
    later = snap((https, eps("10.1.7.2", node="node-a")), (other, eps("10.1.7.1", node="node-a")),
                 node="node-a")
    NftablesBackend(ONE_SHOT if one_shot else CONFIG, kernel=fake).sync(later, Changes())
    assert "10.96.0.70" in fake.tables["ip"].elements[names.CLUSTER_IPS]
    assert "10.1.7.1 . 10.1.7.1" in fake.tables["ip"].elements[names.HAIRPIN]
    assert dumps(fake) == fresh_dumps(later, CONFIG)
    # and when nobody needs them any more, they go
    last = snap((other, eps("10.1.7.3", node="node-a")), node="node-a")
    NftablesBackend(ONE_SHOT, kernel=fake).sync(last, Changes())
    assert dumps(fake) == fresh_dumps(last, CONFIG)


def test_a_shared_chain_goes_with_its_last_user_by_the_kernels_count() -> None:
    fake = _written(_base())
    assert "cluster-tcp-pick-3" in fake.tables["ip"].chains  # web's cluster IP and api
    later = _base()
    later.endpoints[API.name] = eps("10.1.1.1")  # type: ignore[index]
    NftablesBackend(ONE_SHOT, kernel=fake).sync(later, Changes())
    assert "cluster-tcp-pick-3" in fake.tables["ip"].chains  # web still uses it
    later.endpoints[WEB.name] = eps("10.1.0.1", "10.1.0.2")  # type: ignore[index]
    NftablesBackend(ONE_SHOT, kernel=fake).sync(later, Changes())
    assert "cluster-tcp-pick-3" not in fake.tables["ip"].chains
    assert dumps(fake) == fresh_dumps(later, CONFIG)


def test_a_table_of_another_layout_or_rendering_code_is_rewritten(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="netproxy.backends.nftables")
    fake = _written(_base())
    monkeypatch.setattr(stamp, "_CODE", "0" * 16)  # the next process's code differs
    before = len(fake.transactions)
    NftablesBackend(ONE_SHOT, kernel=fake).sync(_base(), Changes())
    assert len(fake.transactions) == before + 1
    assert any(verb == "delete" and type(obj).__name__ == "Table" for verb, _, obj in fake.transactions[-1])
    assert "another netproxy version, layout" in caplog.text
    caplog.clear()
    monkeypatch.setattr(stamp, "LAYOUT_VERSION", 2)  # a table of the layout before (the same digests)
    fake = _written(_base())
    monkeypatch.setattr(stamp, "LAYOUT_VERSION", 3)
    NftablesBackend(ONE_SHOT, kernel=fake).sync(_base(), Changes())
    assert "stamp layout 2" in caplog.text


def test_the_inputs_digest_covers_every_field_and_nothing_else() -> None:
    made_of = {"ip": ipaddress.ip_address("10.1.0.1"), "port": 8080, "node_name": "n", "zone": "z",
               "zone_hints": ("z",), "node_hints": ("n",)}
    ep = Endpoint(**made_of)  # type: ignore[arg-type]
    port = dataclasses.replace(svc("web", "10.96.0.10", external=["192.0.2.1"], lb=["198.51.100.1"]),
                               node_port=30000, source_ranges=(ipaddress.ip_network("10.0.0.0/8"),))
    digest = stamp.input_digest(port, (ep,), "ip")
    # the same values in other objects: the same digest (marshal format 2 keeps no references)
    again = dataclasses.replace(port, protocol="".join(["T", "CP"]))
    assert stamp.input_digest(again, (Endpoint._make(ep),), "ip") == digest
    assert stamp.input_digest(port, (ep,), "ip6") != digest
    assert stamp.input_digest(port, (ep,), "ip", ("10.96.0.10 . tcp . 80",)) != digest
    changed_fields = {"protocol": "UDP", "port": 81, "target_port": 81,
                      "cluster_ips": (ipaddress.ip_address("10.96.0.11"),),
                      "node_port": 30001, "external_ips": (), "load_balancer_ips": (),
                      "source_ranges": (ipaddress.ip_network("10.0.0.0/9"),), "affinity": "ClientIP",
                      "affinity_timeout": 60, "external_traffic_policy": "Local", "internal_traffic_policy": "Local",
                      "health_check_node_port": 1, "service_type": "NodePort", "traffic_distribution": "PreferClose",
                      "proxy_load_balancer_ips": (ipaddress.ip_address("198.51.100.2"),)}
    assert set(changed_fields) | {"name"} == {f.name for f in dataclasses.fields(ServicePort)}
    for name, value in changed_fields.items():
        assert stamp.input_digest(dataclasses.replace(port, **{name: value}), (ep,), "ip") != digest, name
    changed_endpoint = {"ip": ipaddress.ip_address("10.1.0.2"), "port": 8081, "ready": False, "serving": False,
                        "terminating": True, "node_name": "m", "zone": "y", "zone_hints": ("y",), "node_hints": ("m",)}
    # Every value an endpoint is made of (its six fields hold the nine: model.Endpoint).
    assert set(changed_endpoint) == set(inspect.signature(Endpoint).parameters)
    for name, value in changed_endpoint.items():
        changed = Endpoint(**{**made_of, name: value})  # type: ignore[arg-type]
        assert stamp.input_digest(port, (changed,), "ip") != digest, name
    # an IPv4 address and the IPv6 address of the same integer are different endpoints
    same_int = ep._replace(ip=ipaddress.IPv6Address(int(ep.ip)))
    assert stamp.input_digest(port, (same_int,), "ip") != digest


def test_addresses_are_read_through_ipaddress_internals_that_mean_int_and_version() -> None:
    """stamp.py and adopt.py read ``_ip`` and ``_version`` in C rather than ``int()`` and ``.version``:
    pinned here, so that a Python whose ipaddress changes them fails this test, not a restart."""
    for text in ("10.1.2.3", "0.0.0.0", "255.255.255.255", "fd00::1", "::ffff:10.1.2.3", "::"):
        ip = ipaddress.ip_address(text)
        assert stamp._address(ip) == (int(ip), ip.version)
        assert adopt._address_int(ip) == int(ip)
        ep = Endpoint(ip, 1)
        assert stamp._endpoint_values(ep)[:2] == (int(ip), ip.version)
        assert adopt._endpoint_int(ep) == int(ip)


@pytest.mark.parametrize("port", [
    svc("plain", "10.96.0.1"),
    svc("ext", "10.96.0.1", external=["192.0.2.1", "10.96.0.1"], lb=["192.0.2.1", "198.51.100.1"]),
    dataclasses.replace(svc("np", "10.96.0.1", proto="UDP"), node_port=30053),
    dataclasses.replace(svc("dual", "10.96.0.1"), cluster_ips=(ipaddress.ip_address("10.96.0.1"),
                                                               ipaddress.ip_address("fd00::1")), node_port=30000),
    svc("v6only", "fd00::2", external=["2001:db8::1"]),
], ids=lambda p: p.name.name)
def test_dispatch_keys_are_the_renders(port: ServicePort) -> None:
    for fam in ("ip", "ip6"):
        objs = render.render_service(port, eps("10.1.0.1", "fd01::1"), NodeInfo("node-a"), fam, CONFIG)
        assert render.dispatch_keys(port, fam) == objs.dispatch_keys, fam

