"""The nftables tracer as an interpreter of the kernel's expressions, on hand-written rules.

``test_nft_trace.py`` traces what the renderer writes; mutation testing (``make mutation``'s
``nftables-trace`` group, docs/testing.md) showed how much of the interpreter that leaves unread:
registers that the rendered rules happen to write in a forgiving order, verdicts they never use
(an explicit accept, goto, return), loads only the affinity record chains make (which no trace
runs), byte order, marks with bit 31. Each test here writes a few rules whose outcome follows from
the kernel's semantics (nf_tables' registers, verdicts, conntrack keys), not from the tracer."""

from __future__ import annotations

import dataclasses
import ipaddress
import struct
import sys
from typing import Dict, List, Sequence, Tuple

import pytest

from netproxy.backends.nftables import expr as ex
from netproxy.backends.nftables import names, trace, wire
from netproxy.backends.nftables.fake import FakeNft, _FakeTable
from netproxy.backends.nftables.objects import Chain, Element, Rule, Set, Table
from netproxy.backends.nftables.trace import Outcome, Packet, Tracer
from netproxy.core.config import ProxyConfig, parse_cidrs
from netproxy.core.model import Changes, Endpoint, ServicePort
from tests.unit.nftables.nft_helpers import backend, eps, snap, svc

PRE, OUT, POST = names.NAT_PREROUTING, names.NAT_OUTPUT, names.NAT_POSTROUTING
INPUT, FORWARD, OUTPUT = names.FILTER_INPUT, names.FILTER_FORWARD, names.FILTER_OUTPUT
DROP, ACCEPT, RETURN = ex.Verdict(wire.NF_DROP), ex.Verdict(wire.NF_ACCEPT), ex.Verdict(wire.NFT_RETURN)
PACKET = Packet("10.244.1.5", "10.96.0.10", 80)
Exprs = Sequence[object]


def jump(chain: str) -> ex.Verdict:
    return ex.Verdict(wire.NFT_JUMP, chain)


def goto(chain: str) -> ex.Verdict:
    return ex.Verdict(wire.NFT_GOTO, chain)


def eq(reg: int, data: bytes) -> ex.Cmp:
    return ex.Cmp(ex.CMP_EQ, reg, data)


def imm(reg: int, data: bytes) -> ex.Immediate:
    return ex.Immediate(reg, data)


def u32(value: int) -> bytes:
    """A 32-bit value as the kernel keeps it in a register: host byte order."""
    return struct.pack("=I", value)


def be16(port: int) -> bytes:
    return struct.pack(">H", port)


def packed(addr: str) -> bytes:
    return ipaddress.ip_address(addr).packed


IS_SERVICE = (ex.Payload(ex.NETWORK, 16, 4, 1), eq(1, packed("10.96.0.10")),
              ex.Payload(ex.TRANSPORT, 2, 2, 9), eq(9, be16(80)))
"""``ip daddr 10.96.0.10 th dport 80``: reads the packet's address and port."""


def kernel(chains: Dict[str, List[Exprs]], sets: Sequence[Set] = (), elements: Sequence[Element] = ()) -> FakeNft:
    """A fake kernel holding one ``ip`` table with these chains' rules as they are (no renderer)."""
    table = _FakeTable(Table("ip", "netproxy"))
    for name, rules in chains.items():
        table.chains[name] = Chain(name)
        table.rules[name] = [Rule(name, f"rule {i}", None, tuple(exprs)) for i, exprs in enumerate(rules)]
    for s in sets:
        table.sets[s.name], table.elements[s.name] = s, {}
    for e in elements:
        table.elements[e.set][e.key] = e
    fake = FakeNft()
    fake.tables["ip"] = table
    return fake


def run(chains: Dict[str, List[Exprs]], packet: Packet = PACKET) -> List[Outcome]:
    return Tracer(kernel(chains), "ip").trace(packet)


def verdicts(chains: Dict[str, List[Exprs]], packet: Packet = PACKET) -> List[str]:
    return [o.verdict for o in run(chains, packet)]


# -- registers ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", [
    # A 4-byte store into a register an 8-byte store filled leaves the second word alone.
    [imm(8, b"\xaa" * 8), imm(8, b"\xcc" * 4), eq(8, b"\xcc" * 4 + b"\xaa" * 4)],
    # A 2-byte store zeroes the rest of its 32-bit word.
    [imm(8, b"\xaa" * 4), imm(8, b"\x12\x34"), eq(8, b"\x12\x34\0\0")],
    # Stores in any order: a concatenation is read across consecutive registers.
    [imm(9, b"\xbb" * 4), imm(8, b"\xaa" * 4), eq(8, b"\xaa" * 4 + b"\xbb" * 4)],
    [imm(10, b"\xbb" * 4), imm(9, b"\xaa" * 2), eq(9, b"\xaa\xaa\0\0" + b"\xbb" * 4)],
    # The 16-byte register 2 is the 32-bit registers 12 to 15.
    [imm(2, bytes(range(16))), eq(13, bytes(range(4, 8)))],
    # The last 16-byte register, 4, is the 32-bit registers 20 to 23, the register file's end.
    [imm(4, bytes(range(16))), eq(4, bytes(range(16))), eq(20, bytes(range(4)))],
], ids=["store-4-in-8", "pad-2-to-4", "concat", "concat-padded", "reg2-is-reg32-12", "reg4-is-reg32-20"])
def test_registers_hold_what_the_kernel_would(rule: List[object]) -> None:
    assert verdicts({PRE: [rule + [DROP]]}) == ["drop"]


@pytest.mark.parametrize("size, expected", [
    (4, u32(0x01020304) + u32(0x05060708)),
    (2, struct.pack("=HHHH", 0x0102, 0x0304, 0x0506, 0x0708)),
    (1, bytes(range(1, 9))),
])
def test_byteorder_turns_network_order_into_the_hosts_unit_by_unit(size: int, expected: bytes) -> None:
    rule = [imm(8, bytes(range(1, 9))), ex.Byteorder(8, 10, 0, 8, size), eq(10, expected), DROP]
    assert verdicts({PRE: [rule]}) == ["drop"], sys.byteorder


def test_a_mark_with_bit_31_set_is_set_and_read_back() -> None:
    """--masquerade-bit takes 0..31: bit 31 is an unsigned 32-bit mark."""
    rules: List[Exprs] = [[imm(8, u32(0x80000000)), ex.Meta(ex.META_MARK, sreg=8)],
                          [ex.Meta(ex.META_MARK, dreg=9), eq(9, u32(0x80000000)), DROP]]
    assert verdicts({PRE: rules}) == ["drop"]


# -- what a first packet's loads read ------------------------------------------------------------------

def test_a_first_packet_is_exactly_new_and_not_yet_dnat_ed() -> None:
    assert verdicts({PRE: [[ex.Ct(ex.CT_STATE, 8), eq(8, u32(0x8)), DROP]]}) == ["drop"]
    assert verdicts({PRE: [[ex.Ct(ex.CT_STATUS, 8), eq(8, u32(0)), DROP]]}) == ["drop"]
    # Its original destination port, a service port above 32767 (an unsigned 16-bit field).
    high = dataclasses.replace(PACKET, dport=50000)
    assert verdicts({PRE: [[ex.Ct(ex.CT_PROTO_DST, 8), eq(8, be16(50000)), DROP]]}, high) == ["drop"]


def test_the_node_s_own_packets_have_no_input_interface() -> None:
    name = [ex.Meta(ex.META_IIFNAME, dreg=8)]
    own = Packet("10.244.1.5", "10.96.0.10", 80, hook="output", iif="eth0")
    assert verdicts({OUT: [name + [eq(8, b"\0" * 16), DROP]]}, own) == ["drop"]
    routed = Packet("10.244.1.5", "10.96.0.10", 80, iif="eth0")
    assert verdicts({PRE: [name + [eq(8, b"eth0".ljust(16, b"\0")), DROP]]}, routed) == ["drop"]


def test_fib_saddr_looks_up_the_source_address() -> None:
    rule = [ex.Fib(ex.FIB_F_SADDR, 8), eq(8, u32(2)), DROP]  # 2: RTN_LOCAL
    from_node = Packet("192.168.1.10", "10.99.0.1", 80, local=frozenset({"192.168.1.10"}))
    assert verdicts({PRE: [rule]}, from_node) == ["drop"]
    assert verdicts({PRE: [rule]}, dataclasses.replace(from_node, saddr="10.244.1.5")) == ["accept"]


def _dnat(port: int) -> List[object]:
    return [imm(1, packed("10.1.0.1")), imm(2, be16(port)), ex.Nat("ip", 1, 2)]


def test_postrouting_sees_the_packet_as_dnat_left_it_and_conntrack_the_original() -> None:
    """After DNAT (to a port above 32767): ``ct status dnat`` is set, ``ct original`` keeps the
    service's address and port, the reply's source port is the endpoint's, and the packet's own
    headers carry the endpoint."""
    check = [ex.Ct(ex.CT_STATUS, 8), eq(8, u32(0x20)), ex.Ct(ex.CT_DST_IP, 9), eq(9, packed("10.96.0.10")),
             ex.Ct(ex.CT_PROTO_DST, 10), eq(10, be16(80)), ex.Ct(ex.CT_PROTO_SRC, 11), eq(11, be16(40000)),
             ex.Payload(ex.NETWORK, 16, 4, 12), eq(12, packed("10.1.0.1")),
             ex.Payload(ex.TRANSPORT, 2, 2, 13), eq(13, be16(40000)), ex.Masquerade()]
    assert run({PRE: [_dnat(40000)], POST: [check]}) == [
        Outcome("dnat", "10.1.0.1:40000", masquerade=True, chains=(PRE, POST))]
    # The conntrack state goes with the packet into a chain postrouting jumps to.
    assert run({PRE: [_dnat(40000)], POST: [[jump("check")]], "check": [check]}) == [
        Outcome("dnat", "10.1.0.1:40000", masquerade=True, chains=(PRE, POST, "check"))]


def test_without_a_postrouting_chain_the_mark_decides_the_masquerade() -> None:
    mark = [imm(8, u32(0x4000)), ex.Meta(ex.META_MARK, sreg=8)]
    assert run({PRE: [mark, _dnat(8080)]})[0].masquerade
    assert not run({PRE: [_dnat(8080)]})[0].masquerade


# -- verdicts -------------------------------------------------------------------------------------------

def test_each_hook_s_filter_chain_runs_after_nat_with_the_nat_chains_on_its_path() -> None:
    chains: Dict[str, List[Exprs]] = {PRE: [], OUT: [], INPUT: [[ACCEPT]], FORWARD: [[DROP]],
                                      OUTPUT: [[ex.Reject(3)]]}
    to_node = Packet("10.244.1.5", "192.168.1.10", 80, local=frozenset({"192.168.1.10"}))
    assert run(chains, to_node) == [Outcome("accept", chains=(PRE, INPUT))]
    assert run(chains, dataclasses.replace(to_node, daddr="10.99.0.1")) == [Outcome("drop", chains=(PRE, FORWARD))]
    assert run(chains, dataclasses.replace(to_node, hook="output")) == [Outcome("reject", chains=(OUT, OUTPUT))]


def test_a_reject_in_nat_is_final() -> None:
    assert run({PRE: [[ex.Reject(3)]], FORWARD: [[ACCEPT]]}) == [Outcome("reject", chains=(PRE,))]


def test_goto_does_not_come_back() -> None:
    assert run({PRE: [[goto("elsewhere")], [DROP]], "elsewhere": []}) == [Outcome("accept", chains=(PRE, "elsewhere"))]


def test_return_goes_back_to_the_rule_after_the_jump() -> None:
    """The rule after the jump reads the packet's address and port again."""
    chains: Dict[str, List[Exprs]] = {PRE: [[jump("sub")], [*IS_SERVICE, DROP], [ACCEPT]], "sub": [[RETURN], [ACCEPT]]}
    assert run(chains) == [Outcome("drop", chains=(PRE, "sub"))]


def test_a_return_in_a_base_chain_is_its_policy() -> None:
    assert verdicts({PRE: [[RETURN], [DROP]]}) == ["accept"]


def test_a_rule_without_a_verdict_goes_on_to_the_next() -> None:
    assert verdicts({PRE: [[imm(8, u32(1))], [eq(8, u32(1)), DROP], [ACCEPT]]}) == ["drop"]


def test_each_random_branch_keeps_its_share_and_path_to_the_end() -> None:
    """numgen mod 4: one branch dropped (after reading the packet again), three go on to filter."""
    chains: Dict[str, List[Exprs]] = {PRE: [[ex.Numgen(8, 4), eq(8, u32(0)), *IS_SERVICE, DROP]], FORWARD: []}
    assert run(chains) == [Outcome("drop", chains=(PRE,), share=0.25)] + [
        Outcome("accept", chains=(PRE, FORWARD), share=0.25)] * 3


def test_a_reject_in_a_random_branch_keeps_its_share() -> None:
    assert run({PRE: [[ex.Numgen(8, 2), eq(8, u32(1)), ex.Reject(3)]]}) == [
        Outcome("accept", chains=(PRE,), share=0.5), Outcome("reject", chains=(PRE,), share=0.5)]


def test_a_verdict_map_s_plain_verdict() -> None:
    vmap = Set("m", "ipv4_addr", "verdict")
    got = Tracer(kernel({PRE: [[ex.Payload(ex.NETWORK, 16, 4, 1), ex.Lookup("m", 1, dreg=0)]]}, sets=[vmap],
                        elements=[Element("m", "10.96.0.10", "drop")]), "ip").trace(PACKET)
    assert got == [Outcome("drop", chains=(PRE,))]


# -- what the tracer refuses ----------------------------------------------------------------------------

def test_a_looping_ruleset_is_refused_by_name() -> None:
    """Not a RecursionError: the depth limit comes first (it came never, at 10,000 steps)."""
    with pytest.raises(ValueError,
                       match=r"^trace: more than 100 rule steps deep at chain loop; is the ruleset looping\?$"):
        run({PRE: [[jump("loop")]], "loop": [[jump("loop")]]})


def test_the_depth_limit_counts_one_paths_rule_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two rules that do not match and the chain's end: three steps deep, allowed at a limit of
    three again and again on one tracer (the limit is per path: it once counted every packet a
    tracer had traced), refused at two."""
    chains: Dict[str, List[Exprs]] = {PRE: [[eq(8, u32(1)), DROP], [eq(8, u32(1)), DROP]]}
    tracer = Tracer(kernel(chains), "ip")
    monkeypatch.setattr(trace, "_MAX_DEPTH", 3)
    for _ in range(3):
        assert [o.verdict for o in tracer.trace(PACKET)] == ["accept"]
    monkeypatch.setattr(trace, "_MAX_DEPTH", 2)
    with pytest.raises(ValueError, match="more than 2 rule steps deep at chain nat-prerouting"):
        tracer.trace(PACKET)
    monkeypatch.setattr(trace, "_MAX_DEPTH", 3)
    assert [o.verdict for o in tracer.trace(PACKET)] == ["accept"]  # a refused trace left no depth behind


def test_what_the_tracer_cannot_read_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"^no ip6 netproxy table$"):
        Tracer(kernel({PRE: []}), "ip6")
    with pytest.raises(ValueError, match=r"^the tracer does not know 'a string'$"):
        run({PRE: [["a string"]]})


# -- rendered rules the other tests do not trace ---------------------------------------------------------

NODE = "node-a"
CONFIG = ProxyConfig(hostname=NODE, cluster_cidrs=parse_cidrs("10.244.0.0/16"))


def _tracer(*items: Tuple[ServicePort, Tuple[Endpoint, ...]], config: ProxyConfig = CONFIG) -> Tracer:
    b, fake = backend(config)
    b.sync(snap(*items, node=NODE), Changes())
    return Tracer(fake, "ip")


def test_a_pod_reaching_itself_through_its_service_is_masqueraded() -> None:
    """Hairpin: the pod is inside --cluster-cidr, so only postrouting's ``ct status dnat`` rule
    (source and destination the same endpoint) masquerades it; another pod's connection is not."""
    t = _tracer((svc("web", "10.96.0.10"), eps("10.244.1.5")))
    assert [(o.target, o.masquerade) for o in t.trace(Packet("10.244.1.5", "10.96.0.10", 80))] == [
        ("10.244.1.5:8080", True)]
    assert [(o.target, o.masquerade) for o in t.trace(Packet("10.244.1.6", "10.96.0.10", 80))] == [
        ("10.244.1.5:8080", False)]


def test_masquerade_bit_31_marks_and_masquerades() -> None:
    config = dataclasses.replace(CONFIG, masquerade_bit=31)
    t = _tracer((svc("web", "10.96.0.10"), eps("10.1.0.1")), config=config)
    assert [(o.target, o.masquerade) for o in t.trace(Packet("172.16.0.9", "10.96.0.10", 80))] == [
        ("10.1.0.1:8080", True)]


def test_load_balancer_source_ranges_are_each_services_own() -> None:
    """Two load balancers with their own source ranges: a client allowed by one is dropped by the
    other (the range set's key starts with the service's address, protocol and port)."""
    a = dataclasses.replace(svc("a", "10.96.0.10", lb=["198.51.100.10"]),
                            source_ranges=(ipaddress.ip_network("192.0.2.0/24"),))
    b = dataclasses.replace(svc("b", "10.96.0.11", lb=["198.51.100.11"]),
                            source_ranges=(ipaddress.ip_network("203.0.113.0/24"),))
    t = _tracer((a, eps("10.1.0.1")), (b, eps("10.1.0.2")))

    def where(client: str, lb: str) -> List[str]:
        return [o.target or o.verdict for o in t.trace(Packet(client, lb, 80))]

    assert where("192.0.2.7", "198.51.100.10") == ["10.1.0.1:8080"]
    assert where("203.0.113.7", "198.51.100.11") == ["10.1.0.2:8080"]
    assert where("192.0.2.7", "198.51.100.11") == ["drop"]
    assert where("203.0.113.7", "198.51.100.10") == ["drop"]
