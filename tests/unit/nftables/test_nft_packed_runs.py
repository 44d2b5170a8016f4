"""Endpoint runs carry the kernel's bytes (issue 40, the eighth pass): render packs each endpoint from
the model's integers, in numeric order, and the netlink encoder lays a block of runs (and ``hairpin``'s
packed keys) out column by column instead of parsing one text per endpoint.  Each fast path is held
against the element-at-a-time path, which packs the same elements from their text (nft's own bytes
for both are the expectation of test_nft_netlink_nft_bytes.py)."""

from __future__ import annotations

import ipaddress
import pickle
from typing import List, Sequence, Tuple

import pytest

from netproxy.backends.nftables import encode, layout, names, render, serialise, wire
from netproxy.backends.nftables.layout import Pick
from netproxy.backends.nftables.objects import Element, ElementRun, Elements, Set, endpoint_text, pack_endpoint
from netproxy.backends.nftables.serialise import Op
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Changes, NodeInfo

from .nft_helpers import assert_fast_pack_agrees, backend, eps, snap, svc

CONFIG = ProxyConfig(hostname="node-a")


def _flat(ops: Sequence[Op]) -> List[Op]:
    """``ops`` with every group and run written as its elements one by one (the text path)."""
    out: List[Op] = []
    for verb, fam, obj in ops:
        items = obj.items if isinstance(obj, Elements) else (obj,)
        for item in items:
            if isinstance(item, ElementRun):
                out.extend((verb, fam, e) for e in item.elements())
            else:
                out.append((verb, fam, item))
    return out


def _messages(ops: Sequence[Op]) -> Tuple[List[encode.Message], List[Op]]:
    got = list(encode.Encoder().messages(ops))
    return [m for m, _ in got], [op for _, op in got]


def test_a_run_lists_its_endpoints_in_numeric_order() -> None:
    """Index i is the i-th endpoint by address, then port (10.1.0.9 before 10.1.0.10, which text
    order put after 10.1.0.1); the same in the nft text the libnftables writer and `plan` give."""
    endpoints = eps("10.1.0.10", "10.1.0.9", "10.1.0.1") + eps("10.1.0.9", port=80)
    objs = render.render_service(svc("web", "10.96.0.10"), endpoints, NodeInfo("node-a"), "ip", CONFIG)
    run = objs.runs[("main", "10.96.0.10 . tcp . 80")]
    assert run.values == ("10.1.0.1 . 8080", "10.1.0.9 . 80", "10.1.0.9 . 8080", "10.1.0.10 . 8080")
    assert run.packed == b"".join(pack_endpoint(v) for v in run.values) and run.width == 8
    v6 = render.render_service(svc("v6", "fd00::10"), eps("fd01::10", "fd01::9", "fd01::a"), NodeInfo("node-a"),
                               "ip6", CONFIG).runs[("main", "fd00::10 . tcp . 80")]
    assert v6.values == ("fd01::9 . 8080", "fd01::a . 8080", "fd01::10 . 8080") and v6.width == 20
    b, _ = backend()
    text = b.plan(snap((svc("web", "10.96.0.10"), endpoints)))
    assert ("10.96.0.10 . 80 . 0 : 10.1.0.1 . 8080, 10.96.0.10 . 80 . 1 : 10.1.0.9 . 80, "
            "10.96.0.10 . 80 . 2 : 10.1.0.9 . 8080, 10.96.0.10 . 80 . 3 : 10.1.0.10 . 8080") in text


@pytest.mark.parametrize("text", ["10.1.0.1 . 8080", "0.0.0.0 . 1", "255.255.255.255 . 65535", "fd01::1 . 80",
                                  "::ffff:10.0.0.1 . 443", "::1 . 9", "2001:db8::1:0:0:1 . 8"])
def test_an_endpoint_value_reads_back_as_the_text_render_wrote(text: str) -> None:
    address = ipaddress.ip_address(text.split(" . ")[0])
    ep = eps(str(address), port=int(text.split(" . ")[1]))[0]
    value = render.endpoint_value(ep)
    assert value == pack_endpoint(text) and endpoint_text(value) == f"{address} . {ep.port}"
    assert len(value) == render.WIDTHS["ip" if address.version == 4 else "ip6"]


@pytest.mark.parametrize("bad", ["10.1.0.1", "10.1.0.1 . x", "10.1.0.1 . 80 . 1", "10.1.0.1 . 70000", "? . 80"])
def test_a_value_that_is_not_an_endpoint_is_refused_naming_it(bad: str) -> None:
    with pytest.raises(ValueError, match="endpoint value"):
        ElementRun("eps", "10.96.0.10 . 80", ("10.1.0.2 . 80", bad))


def test_a_run_of_unknown_values_differs_from_every_endpoint_at_every_index() -> None:
    """Adoption's old objects before it reads their values (adopt._ghost): as many elements, in the
    family's width, none equal to a rendered endpoint (port 0)."""
    for fam, width in (("ip", 8), ("ip6", 20)):
        ghost = ElementRun.unknown("eps", "10.96.0.10 . 80", 3, fam)
        assert (ghost.size, ghost.width, ghost.indexed) == (3, width, True)
        assert all(v.endswith(" . 0") for v in ghost.values)
        assert not ElementRun.unknown("eps", "p", 1, fam).indexed
        assert pickle.loads(pickle.dumps(ghost)) == ghost


def _map(pick: Pick, family: str = "ip") -> Set:
    return layout.endpoints_map(pick, family)


def _runs(count: int, n: int, family: str = "ip", nodeport: bool = False) -> List[ElementRun]:
    pick = Pick("cluster", "tcp", n, nodeport)
    out = []
    for i in range(count):
        if family == "ip":
            values = [f"10.{1 + i // 250}.{i % 250}.{j + 1} . {8000 + j}" for j in range(n)]
            prefix = f"{30000 + i}" if nodeport else f"10.96.{i // 250}.{i % 250} . 80"
        else:
            values = [f"fd01::{i:x}:{j + 1:x} . {8000 + j}" for j in range(n)]
            prefix = f"{30000 + i}" if nodeport else f"fd00::{i:x} . 80"
        out.append(ElementRun(pick.map, prefix, values))
    return out


@pytest.mark.parametrize("family, n, nodeport", [("ip", 3, False), ("ip", 1, False), ("ip", 4, True), ("ip", 1, True),
                                                 ("ip6", 2, False), ("ip6", 1, True)])
@pytest.mark.parametrize("verb", ["add", "delete"])
def test_a_block_of_runs_encodes_as_its_elements_one_by_one(family: str, n: int, nodeport: bool, verb: str) -> None:
    runs = _runs(7, n, family, nodeport)
    emap = _map(Pick("cluster", "tcp", n, nodeport), family)
    for shape in ([(verb, family, Elements(emap.name, tuple(runs)))], [(verb, family, r) for r in runs]):
        ops: List[Op] = [("add", family, emap), *shape]
        fast, _ = _messages(ops)
        slow, _ = _messages(_flat(ops))
        assert fast == slow


@pytest.mark.parametrize("family, nodeport, unit", [("ip", False, 40), ("ip", True, 36), ("ip6", False, 64)])
def test_a_block_larger_than_a_message_splits_where_elements_one_by_one_split(family: str, nodeport: bool,
                                                                             unit: int) -> None:
    """Runs of 10, ~1 MB of elements (40, 36, 64 bytes each: a message's 60,000 bytes not always a
    multiple): the messages (each under 64 KB) and the operation each one names (a refused one names
    its first element's run) are those of the elements one at a time."""
    runs = _runs(2500 if family == "ip" else 1600, 10, family, nodeport)
    emap = _map(Pick("cluster", "tcp", 10, nodeport), family)
    key = "30999" if nodeport else ("10.200.0.1 . 80" if family == "ip" else "fd00::1 . 80")
    few = [Element(emap.name, f"{key} . 0", "10.2.0.1 . 80" if family == "ip" else "fd02::1 . 80")]
    ops: List[Op] = [("add", family, emap), ("add", family, few[0]),
                     ("add", family, Elements(emap.name, tuple(runs)))]
    fast, named = _messages(ops)
    slow, slow_named = _messages(_flat(ops))
    assert len(fast) > 10 and fast == slow
    # Read without the encoder's chunking: whole elements in every message, as many as fit.
    counts = []
    for _, _, _, body in fast[1:]:
        listed = wire.attributes(body)[wire.SET_ELEM_LIST_ELEMENTS]
        elements = wire.attribute_list(listed)
        assert {len(e) + 4 for _, e in elements} == {unit} and len(listed) == unit * len(elements) < 65536
        counts.append(len(elements))
    assert sum(counts) == 1 + 10 * len(runs)
    assert counts[:-1] == [encode._ELEMENTS_PER_MESSAGE_BYTES // unit] * (len(counts) - 1)
    assert named[0] == slow_named[0] == ops[0]
    # Past the map: the one-by-one path names an element, the block the run that holds that element.
    assert named[1] == slow_named[1] == ops[1]
    for got, want in zip(named[2:], slow_named[2:]):
        assert isinstance(got[2], ElementRun) and isinstance(want[2], Element)
        assert want[2] in got[2].elements()


def test_hairpins_packed_keys_encode_as_their_elements() -> None:
    hairpin = Set(names.HAIRPIN, "ipv4_addr . ipv4_addr")
    hairpin6 = Set(names.HAIRPIN, "ipv6_addr . ipv6_addr")
    v4 = render.HairpinElements("ip", [int(ipaddress.ip_address(f"10.1.{i // 200}.{i % 200}")) for i in range(9000)])
    v6 = render.HairpinElements("ip6", [int(ipaddress.ip_address(a))
                                        for a in ("::ffff:10.0.0.1", "fd01::1", "fd01::2:3")])
    for verb in ("add", "delete"):
        ops: List[Op] = [("add", "ip", hairpin), (verb, "ip", Elements(names.HAIRPIN, v4)),
                         ("add", "ip6", hairpin6), (verb, "ip6", Elements(names.HAIRPIN, v6))]
        fast, named = _messages(ops)
        slow, slow_named = _messages(_flat(ops))
        assert len(fast) > 3 and fast == slow and named == slow_named


def test_a_run_that_does_not_fit_its_map_is_refused_naming_it() -> None:
    emap = _map(Pick("cluster", "tcp", 2))
    v6 = ElementRun(emap.name, "10.96.0.10 . 80", ("fd01::1 . 80", "fd01::2 . 80"))
    with pytest.raises(encode.EncodeError, match="10.96.0.10 . 80: values of 20 bytes"):
        list(encode.Encoder().messages([("add", "ip", emap), ("add", "ip", v6)]))
    one = _map(Pick("cluster", "tcp", 1))
    two = ElementRun(one.name, "10.96.0.10 . 80", ("10.1.0.1 . 80", "10.1.0.2 . 80"))
    with pytest.raises(encode.EncodeError, match="2 values in cluster-tcp-endpoints-1, keyed without an index"):
        list(encode.Encoder().messages([("add", "ip", one), ("add", "ip", two)]))
    bad_prefix = ElementRun(emap.name, "10.96.0.10", ("10.1.0.1 . 80", "10.1.0.2 . 80"))
    with pytest.raises(encode.EncodeError, match="does not fit"):
        list(encode.Encoder().messages([("add", "ip", emap), ("add", "ip", bad_prefix)]))


def test_an_endpoint_change_rewrites_its_index_alone_with_text_values() -> None:
    b, fake = backend()
    web = svc("web", "10.96.0.10")
    b.sync(snap((web, eps("10.1.0.1", "10.1.0.2", "10.1.0.3"))), Changes())
    b.sync(snap((web, eps("10.1.0.1", "10.1.0.2", "10.1.0.4"))), Changes(full=False, services=frozenset({web.name})))
    text = serialise.ops_text(fake.transactions[-1])
    assert "delete element ip netproxy cluster-tcp-endpoints-3 { 10.96.0.10 . 80 . 2 }" in text
    assert "add element ip netproxy cluster-tcp-endpoints-3 { 10.96.0.10 . 80 . 2 : 10.1.0.4 . 8080 }" in text
    assert text.count("cluster-tcp-endpoints-3") == 2, text


def test_replacing_a_runs_values_with_none_keeps_its_width() -> None:
    run = ElementRun("eps", "fd00::10 . 80", ("fd01::1 . 80",))
    empty = run._replace(values=())
    assert (empty.size, empty.width, empty.values, empty.keys()) == (0, 20, (), [])
    assert run._replace(values=("fd01::2 . 81",)).values == ("fd01::2 . 81",)


@pytest.mark.parametrize("fields, good, odd", [
    (("ipv4_addr",), ["10.96.0.10", "0.0.0.0"], ["10.96.0.10 . 80", "x", "", "10.1"]),
    (("ipv6_addr",), ["fd00::1", "::ffff:10.0.0.1", "2001:db8::"], ["fd00::1 . 80", "10.0.0.1", "x"]),
    (("inet_service",), ["80", "65535"], ["99999", "tcp", "80 . 80"]),
    (("inet_proto",), ["tcp", "udp", "6"], ["http", "300"]),
    (("ipv4_addr", "inet_proto", "inet_service"), ["10.96.0.10 . tcp . 80", "0.0.0.0 . udp . 1"],
     ["10.96.0.10 . tcp", "10.96.0.10 . tcp . 80 . 1", "10.96.0.10 . ftp . 80", " .  . ", "x . tcp . 80"]),
    # inet_aton takes "10.0.0.1 . 5" (what follows a space is ignored): a fourth field must not hide there.
    (("inet_proto", "inet_service", "ipv4_addr"), ["tcp . 80 . 10.0.0.1"], ["tcp . 80 . 10.0.0.1 . 5"]),
])
def test_the_one_and_three_field_fast_paths_pack_as_the_general_one(fields: Tuple[str, ...], good: List[str],
                                                                    odd: List[str]) -> None:
    assert_fast_pack_agrees(encode.Packer(fields), good, odd)


def test_commented_plain_elements_encode_as_the_general_path() -> None:
    """``service-stamps``' elements (a key and a comment, no value) take the fixed-size path with the
    comment's length in the element's header; the bytes are the general construction's."""
    stamps = Set(names.SERVICE_STAMPS, "ipv6_addr")
    elements = [Element(names.SERVICE_STAMPS, f"fd00::{i:x}", None, "ns/svc-" + "x" * i + ":http d:0123 n:2")
                for i in range(0, 130, 7)] + [Element(names.SERVICE_STAMPS, "::1")]
    for verb in ("add", "delete"):
        (_, _, _, body), = [m for m, _ in encode.Encoder().messages([("add", "ip6", stamps)]
                                                                     + [(verb, "ip6", e) for e in elements])][1:]
        want = []
        for e in elements:
            inner = wire.data_value(wire.ELEM_KEY, ipaddress.ip_address(e.key).packed)
            if e.comment is not None and verb == "add":
                inner += wire.attr(wire.ELEM_USERDATA, wire.udata((0, wire.udata_strz(names.comment(e.comment)))))
            want.append(wire.nest(wire.LIST_ELEM, inner))
        assert body.endswith(wire.nest(wire.SET_ELEM_LIST_ELEMENTS, *want))


@pytest.mark.parametrize("fields, good, bad", [
    (("ipv4_addr", "inet_service", "integer"), ["10.96.0.10 . 80"], ["10.96.0.10", "10.96.0.10 . 80 . 1", "x . 80"]),
    (("inet_service", "integer"), ["30080"], ["30080 . 1", "x"]),
    (("ipv4_addr", "integer"), ["10.96.0.10"], ["10.96.0.10 . 5"]),
    (("ipv4_addr", "ipv4_addr", "integer"), ["10.0.0.1 . 10.0.0.2"], ["10.0.0.1 . 10.0.0.2 . 5"]),
])
def test_a_runs_prefix_packs_as_the_general_prefix(fields: Tuple[str, ...], good: List[str], bad: List[str]) -> None:
    p = encode.Packer(fields)
    fast = p.prefix_packer()
    for text in good:
        assert fast(text) == p.prefix(text) and len(fast(text)) == p.length - 4
    for text in bad:
        with pytest.raises(encode.EncodeError):
            fast(text)


def test_endpoints_at_one_address_and_port_keep_their_order_whatever_else_differs() -> None:
    """Sorted on their bytes alone: two endpoints with one address and port (two slices listing it,
    one with its node) are not compared as objects (None against a node name cannot be)."""
    endpoints = eps("10.1.0.2") + eps("10.1.0.1", node="node-a") + eps("10.1.0.1")
    objs = render.render_service(svc("web", "10.96.0.10"), endpoints, NodeInfo("node-a"), "ip", CONFIG)
    assert objs.runs[("main", "10.96.0.10 . tcp . 80")].values == ("10.1.0.1 . 8080",) * 2 + ("10.1.0.2 . 8080",)
