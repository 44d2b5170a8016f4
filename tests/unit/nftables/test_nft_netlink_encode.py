"""The netlink encoder without a kernel: expressions and user data byte for byte as nft 1.0.6 wrote
them (captured from `nft --debug=netlink` and from the kernel's dump of sets nft created), element
packing, message framing, and the batch socket's answers (a fake socket)."""

from __future__ import annotations

import errno
import struct
from typing import List, Tuple

import pytest

from netproxy.backends.nftables import encode, wire
from netproxy.backends.nftables import stmt as st
from netproxy.backends.nftables.kernel import nlsocket
from netproxy.backends.nftables.objects import Element, ElementRun, Set, Table

from .nft_helpers import assert_fast_pack_agrees


def _debug(rule_stmts: List[st.Stmt]) -> List[str]:
    return [e.debug() for e in st.rule("c", *rule_stmts).exprs]


def test_dispatch_and_dnat_are_nfts_sequences() -> None:
    assert _debug([st.vmap((st.addr("ip", "daddr"), st.L4PROTO, st.DPORT), "service-ips")]) == [
        "[ payload load 4b @ network header + 16 => reg 1 ]",
        "[ meta load l4proto => reg 9 ]",
        "[ payload load 2b @ transport header + 2 => reg 10 ]",
        "[ lookup reg 1 set service-ips dreg 0 ]"]
    assert _debug([st.l4proto("tcp"), st.dnat_map("ip", (st.addr("ip", "daddr"), st.DPORT, st.numgen(3)), "eps")]) == [
        "[ meta load l4proto => reg 1 ]",
        "[ cmp eq reg 1 0x00000006 ]",
        "[ payload load 4b @ network header + 16 => reg 1 ]",
        "[ payload load 2b @ transport header + 2 => reg 9 ]",
        "[ numgen reg 10 = random mod 3 ]",
        "[ lookup reg 1 set eps dreg 1 ]",
        "[ nat dnat ip addr_min reg 1 proto_min reg 9 ]"]


def test_ipv6_registers_and_an_interval_concatenation_as_nft_1_1() -> None:
    """No byteorder after ``meta l4proto``: nft 1.1 emits none, Debian 13's kernel refuses nft
    1.0's no-op one (EOPNOTSUPP)."""
    fam = "ip6"
    fields = (st.addr(fam, "daddr"), st.L4PROTO, st.DPORT, st.addr(fam, "saddr"))
    assert _debug([st.lookup(fields, "fwa", invert=True), st.DROP]) == [
        "[ payload load 16b @ network header + 24 => reg 1 ]",
        "[ meta load l4proto => reg 2 ]",
        "[ payload load 2b @ transport header + 2 => reg 13 ]",
        "[ payload load 16b @ network header + 8 => reg 14 ]",
        "[ lookup reg 1 set fwa 0x1 ]",
        "[ immediate reg 0 drop ]"]
    assert _debug([st.CT_STATE_NEW, st.fib_local("daddr"), st.addr_not_in(fam, "daddr", "::1")]) == [
        "[ ct load state => reg 1 ]",
        "[ bitwise reg 1 = ( reg 1 & 0x00000008 ) ^ 0x00000000 ]",
        "[ cmp neq reg 1 0x00000000 ]",
        "[ fib daddr type => reg 1 ]",
        "[ cmp eq reg 1 0x00000002 ]",
        "[ payload load 16b @ network header + 24 => reg 1 ]",
        "[ cmp neq reg 1 0x00000000 0x00000000 0x00000000 0x01000000 ]"]


def test_marks_masquerade_and_the_affinity_record() -> None:
    assert _debug([st.mark_has(0x4000), st.mark_xor(0x4000), st.MASQUERADE_FULLY_RANDOM]) == [
        "[ meta load mark => reg 1 ]",
        "[ bitwise reg 1 = ( reg 1 & 0x00004000 ) ^ 0x00000000 ]",
        "[ cmp eq reg 1 0x00004000 ]",
        "[ meta load mark => reg 1 ]",
        "[ bitwise reg 1 = ( reg 1 & 0xffffffff ) ^ 0x00004000 ]",
        "[ meta set mark with reg 1 ]",
        "[ masq flags 0x10 ]"]
    record = st.update("affinity-tcp", (st.addr("ip", "saddr"), st.ct_daddr("ip"), st.CT_PROTO_DST),
                       (st.addr("ip", "daddr"), st.DPORT), 10800)
    assert _debug([st.l4proto("tcp"), record])[2:] == [
        "[ payload load 4b @ network header + 12 => reg 1 ]",
        "[ ct load dst_ip => reg 9 , dir original ]",
        "[ ct load proto_dst => reg 10 , dir original ]",
        "[ payload load 4b @ network header + 16 => reg 2 ]",
        "[ payload load 2b @ transport header + 2 => reg 13 ]",
        "[ dynset update reg_key 1 set affinity-tcp sreg_data 2 timeout 10800000ms ]"]


def test_the_ipv6_affinity_record_is_nft_1_1s_sequence() -> None:
    """nft 1.1.3's --debug=netlink for the IPv6 record (Debian 13): the data right after the 9-word
    key (sreg_data 17); nft 1.0.6's rounding up to the next 16-byte register does not fit (it aborts)."""
    fam = "ip6"
    record = st.update("affinity-tcp", (st.addr(fam, "saddr"), st.ct_daddr(fam), st.CT_PROTO_DST),
                       (st.addr(fam, "daddr"), st.CT_REPLY_PROTO_SRC), 600)
    assert _debug([record]) == [
        "[ payload load 16b @ network header + 8 => reg 1 ]",
        "[ ct load dst_ip6 => reg 2 , dir original ]",
        "[ ct load proto_dst => reg 3 , dir original ]",
        "[ payload load 16b @ network header + 24 => reg 17 ]",
        "[ ct load proto_src => reg 21 , dir reply ]",
        "[ dynset update reg_key 1 set affinity-tcp sreg_data 17 timeout 600000ms ]"]
    remembered = st.dnat_map(fam, (st.addr(fam, "saddr"), st.addr(fam, "daddr"), st.DPORT), "affinity-tcp")
    assert _debug([remembered]) == [
        "[ payload load 16b @ network header + 8 => reg 1 ]",
        "[ payload load 16b @ network header + 24 => reg 2 ]",
        "[ payload load 2b @ transport header + 2 => reg 3 ]",
        "[ lookup reg 1 set affinity-tcp dreg 1 ]",
        "[ nat dnat ip6 addr_min reg 1 proto_min reg 2 ]"]


def test_set_user_data_is_what_nft_writes() -> None:
    """Bytes read back from the kernel after nft 1.0.6 created these sets."""
    verdict_map = Set("sips", "ipv4_addr . inet_proto . inet_service", "verdict")
    assert encode.set_udata(verdict_map).hex() == "000400000000010400000000030800040d0000000100060400000000"
    assert encode.set_udata(Set("cips", "ipv4_addr")).hex() == "000402000000"
    typeof = Set("eps", "ip daddr . th dport . numgen random mod 1", "ip daddr . th dport", typeof=True)
    assert encode.set_udata(typeof).hex() == (
        "000400000000010400000000035000040d00000001480014000407000000010c00040c00000001040c000000011400"
        "0407000000010c00040b000000010402000000021a0004170000000112000401000000010401000000020400000000"
        "043400040d000000012c0014000407000000010c00040c00000001040c0000000114000407000000010c00040b0000"
        "00010402000000060400000000")
    sticky = Set("aff", "ipv6_addr . ipv6_addr . inet_service", flags=("dynamic", "timeout"), timeout=60,
                 comment="ns/x:y")
    assert encode.set_udata(sticky).hex() == "000400000000030800040d000000010007076e732f783a7900"


def test_elements_pack_per_field_and_runs_equal_single_elements() -> None:
    m = Set("eps", "ip daddr . th dport . numgen random mod 1", "ip daddr . th dport", typeof=True)
    enc = encode.Encoder()
    endpoints = ElementRun("eps", "10.96.0.10 . 80", ("10.1.0.1 . 8080", "10.1.0.2 . 8080"))
    run = [("add", "ip", m), ("add", "ip", endpoints)]
    single = [("add", "ip", m)] + [("add", "ip", e) for e in endpoints.elements()]
    a = [msg for msg, _ in enc.messages(run)]
    b = [msg for msg, _ in encode.Encoder().messages(single)]
    assert a[1][3] == b[1][3]
    body = a[1][3]
    key = bytes([10, 96, 0, 10]) + (80).to_bytes(2, "big") + b"\0\0" + struct.pack("=I", 1)
    assert key in body and bytes([10, 1, 0, 2]) + (8080).to_bytes(2, "big") + b"\0\0" in body
    with pytest.raises(encode.EncodeError, match="does not fit"):
        list(encode.Encoder().messages([("add", "ip", m), ("add", "ip", Element("eps", "10.96.0.10 . 80", "x"))]))


def test_messages_and_batches_frame_as_netlink_wants() -> None:
    msg = wire.message(wire.NEWTABLE, wire.NLM_F_CREATE, 7, 2, wire.string(wire.TABLE_NAME, "netproxy"))
    length, kind, flags, seq, _ = struct.unpack_from("=IHHII", msg)
    assert (length, kind, flags, seq) == (len(msg), (10 << 8) | wire.NEWTABLE, wire.NLM_F_CREATE, 7)
    assert msg[16:20] == bytes([2, 0, 0, 0])  # nfgenmsg: AF_INET, version 0, res_id 0
    begin = wire.batch_begin(1)
    assert struct.unpack_from("=H", begin, 4)[0] == wire.NFNL_MSG_BATCH_BEGIN and begin[18:20] == b"\x00\x0a"
    assert len(wire.attr(1, b"abc")) == 8 and wire.attr(1, b"abc")[:4] == struct.pack("=HH", 7, 1)
    assert struct.unpack_from("=H", wire.nest(3, b""), 2)[0] == 3 | wire.NLA_F_NESTED
    table = list(encode.Encoder().messages([("add", "ip", Table("ip", "netproxy", "hi"))]))[0][0]
    assert table[0] == wire.NEWTABLE and wire.attributes(table[3])[wire.TABLE_USERDATA] == b"\x00\x03hi\x00"


class _FakeSock:
    """What the kernel answers a batch: one NLMSG_ERROR per message (errno 0: ACK)."""

    def __init__(self, answers: List[bytes], enobufs: int = 0) -> None:
        self.answers = answers
        self.enobufs = enobufs
        self.sent: List[bytes] = []

    def setsockopt(self, *args: object) -> None:
        pass

    def sendall(self, data: bytes) -> None:
        self.sent.append(data)

    def sendmsg(self, buffers: List[bytes]) -> int:
        self.sent.append(b"".join(buffers))
        return len(self.sent[-1])

    def recv(self, size: int, flags: int = 0) -> bytes:
        if flags:  # MSG_PEEK | MSG_DONTWAIT
            if not self.answers:
                raise BlockingIOError
            return self.answers[0][:1]
        if self.enobufs:
            self.enobufs -= 1
            raise OSError(errno.ENOBUFS, "No buffer space available")
        return self.answers.pop(0)


def _answer(seq: int, err: int) -> bytes:
    inner = struct.pack("=IHHII", 16, 0, 0, seq, 0)
    payload = struct.pack("=i", -err) + inner
    return struct.pack("=IHHII", 16 + len(payload), wire.NLMSG_ERROR, 0, seq, 0) + payload


def _socket(answers: List[bytes], enobufs: int = 0) -> nlsocket.NlSocket:
    s = nlsocket.NlSocket.__new__(nlsocket.NlSocket)
    s.sock = _FakeSock(answers, enobufs)  # type: ignore[assignment]
    s._seq = 100
    return s


def test_a_refusal_names_the_index_of_its_message() -> None:
    bodies = [(wire.NEWTABLE, 0, 2, b""), (wire.NEWCHAIN, 0, 2, b""), (wire.NEWRULE, 0, 2, b"")]
    s = _socket([_answer(102, 0), _answer(103, errno.ENOENT), _answer(104, 0)])
    with pytest.raises(nlsocket.NetlinkError) as err:
        s.send_batch(bodies)
    assert err.value.seq == 1 and err.value.errno == errno.ENOENT
    assert len(s.sock.sent) == 1, "the whole batch in one sendmsg"  # type: ignore[attr-defined]


def test_a_batch_sent_as_a_vector_is_the_messages_end_to_end() -> None:
    bodies = [(wire.NEWTABLE, 0, 2, b"\x08\x00\x01\x00ab\x00\x00"), (wire.NEWCHAIN, 0, 10, b"")]
    s = _socket([_answer(102, 0), _answer(103, 0)])
    assert s.send_batch(bodies) is True
    expected = (wire.batch_begin(101)
                + wire.message(wire.NEWTABLE, wire.NLM_F_REQUEST | wire.NLM_F_ACK, 102, 2, bodies[0][3])
                + wire.message(wire.NEWCHAIN, wire.NLM_F_REQUEST | wire.NLM_F_ACK, 103, 10, b"")
                + wire.batch_end(104))
    assert s.sock.sent == [expected]  # type: ignore[attr-defined]


def test_a_generator_of_messages_is_sent_as_the_same_one_batch() -> None:
    """The netlink writer hands its encoder's messages over as they are made (a generator): the
    batch is the one the list gives, byte for byte, in one sendmsg."""
    bodies = [(wire.NEWTABLE, 0, 2, b"\x08\x00\x01\x00ab\x00\x00"), (wire.NEWCHAIN, 0, 10, b"x" * 300000),
              (wire.NEWRULE, 0, 2, b"")]
    as_list = _socket([_answer(102, 0), _answer(103, 0), _answer(104, 0)])
    assert as_list.send_batch(bodies) is True
    as_generator = _socket([_answer(102, 0), _answer(103, 0), _answer(104, 0)])
    assert as_generator.send_batch(b for b in bodies) is True
    assert as_generator.sock.sent == as_list.sock.sent  # type: ignore[attr-defined]
    assert len(as_generator.sock.sent) == 1  # type: ignore[attr-defined]


def test_a_generated_batch_is_held_in_memory_once() -> None:
    """20 MB of messages from a generator: the socket's buffers hold the batch, each message is
    freed once copied (a list of the messages joined for sendmsg held it twice: 156 MB at 100k)."""
    import tracemalloc

    class Counting(_FakeSock):
        def sendmsg(self, buffers: List[bytes]) -> int:
            return sum(len(b) for b in buffers)

    count, size = 400, 50000
    s = _socket([_answer(102 + i, 0) for i in range(count)])
    s.sock = Counting(s.sock.answers)  # type: ignore[attr-defined,assignment]
    tracemalloc.start()
    try:
        assert s.send_batch((wire.NEWSETELEM, 0, 2, bytes([i % 251]) * size) for i in range(count)) is True
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1.3 * count * size, f"peak {peak:,} bytes for a {count * size:,}-byte batch"


def test_a_vector_longer_than_iov_max_is_joined_into_fewer_buffers() -> None:
    parts = [bytes([i % 251]) * 4 for i in range(3 * nlsocket._IOV_MAX + 7)]
    vector = nlsocket._vector(parts)
    assert len(vector) <= nlsocket._IOV_MAX
    assert b"".join(vector) == b"".join(parts)
    assert nlsocket._vector(parts[:10]) == parts[:10]


def test_a_failed_commit_answers_once_for_the_batch() -> None:
    s = _socket([_answer(101, errno.EBUSY)])
    with pytest.raises(nlsocket.NetlinkError) as err:
        s.send_batch([(wire.NEWTABLE, 0, 2, b"")])
    assert err.value.seq == -1


def test_lost_answers_are_reported_not_fatal() -> None:
    s = _socket([_answer(102, 0)], enobufs=1)
    assert s.send_batch([(wire.NEWTABLE, 0, 2, b""), (wire.NEWCHAIN, 0, 2, b"")]) is False
    s = _socket([_answer(102, 0), _answer(103, 0)])
    assert s.send_batch([(wire.NEWTABLE, 0, 2, b""), (wire.NEWCHAIN, 0, 2, b"")]) is True


@pytest.mark.parametrize("fields, good", [
    (("ipv4_addr", "inet_service"), ["10.1.2.3 . 8080", "0.0.0.0 . 1", "255.255.255.255 . 65535"]),
    (("ipv4_addr", "ipv4_addr"), ["10.0.0.1 . 10.0.0.1"]),
    (("inet_proto", "inet_service"), ["tcp . 80", "udp . 53", "sctp . 9"]),
    (("ipv6_addr", "inet_service"), ["fd00::1 . 80", "::ffff:10.0.0.1 . 443"]),
])
def test_the_two_field_fast_path_packs_as_the_general_one(fields: Tuple[str, str], good: List[str]) -> None:
    p = encode.Packer(fields)
    for wrong_count in ["10.1.2.3", "10.1.2.3 . 80 . 9"]:
        for fn in (p, p.pack):
            with pytest.raises(encode.EncodeError):
                fn(wrong_count)
    # (inet_aton takes "80" as an address: the general path decides)
    assert_fast_pack_agrees(p, good, ["x . 80", "10.1.2.3 . 99999999", " . ", "fd00::1 . tcp", "80 . 80"])


def test_verdict_elements_with_comments_encode_as_the_general_path() -> None:
    """A dispatch map's elements (key → goto chain, with the service's comment) take a path with the
    key's headers and each verdict encoded once; bytes as the general construction's, timeouts aside.
    (A consistency check between two paths; what both must equal, nft's own bytes, is the
    expectation of test_nft_netlink_nft_bytes.py.)"""
    from netproxy.backends.nftables import names

    m = Set("service-ips", "ipv4_addr . inet_proto . inet_service", "verdict")
    elements = [Element("service-ips", f"10.96.0.{i} . tcp . 80", f"goto pick-{i % 3}", f"ns/svc-{i}")
                for i in range(40)] + [Element("service-ips", "10.96.1.1 . udp . 53", "drop")]
    (_, (_, _, _, body)), = [(None, msg) for msg, _ in encode.Encoder().messages(
        [("add", "ip", m)] + [("add", "ip", e) for e in elements])][1:]
    packer = encode.Packer(("ipv4_addr", "inet_proto", "inet_service"))
    want = []
    for e in elements:
        inner = wire.data_value(wire.ELEM_KEY, packer(e.key)) + encode._verdict(str(e.value))
        if e.comment is not None:
            inner += wire.attr(wire.ELEM_USERDATA, wire.udata((0, wire.udata_strz(names.comment(e.comment)))))
        want.append(wire.nest(wire.LIST_ELEM, inner))
    assert body.endswith(wire.nest(wire.SET_ELEM_LIST_ELEMENTS, *want))


def test_a_goto_statement_is_nfts_immediate_verdict() -> None:
    """Rendered for the affinity exemption of a Local-policy service (render._affinity_rules); its
    expression had no unit test (a mutant dropping the chain survived mutation testing)."""
    assert _debug([st.goto("affinity-tcp-exempt")]) == ["[ immediate reg 0 goto -> affinity-tcp-exempt ]"]


def test_a_dump_reads_back_what_was_encoded_and_decodes_each_distinct_verdict_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """readback's element parser over the bytes the encoder writes (the kernel dumps elements in the
    same attributes): every key, verdict and comment back, and a verdict decoded once per distinct
    verdict, not per element (10k-100k dispatch elements jump to a few dozen pick chains)."""
    from netproxy.backends.nftables.kernel import readback

    spec = Set("service-ips", "ipv4_addr . inet_proto . inet_service", "verdict")
    elements = [Element("service-ips", f"10.96.{i // 250}.{i % 250 + 1} . tcp . 80",
                        f"goto cluster-tcp-pick-{2 + i % 3}", f"ns/svc-{i}:http") for i in range(3000)]
    encoder = encode.Encoder({("ip", "service-ips"): spec})
    dumped = [wire.attributes(body) for (_, _, _, body), _ in encoder.messages([("add", "ip", e) for e in elements])]
    assert len(dumped) > 1  # the elements span several messages, as a dump's do
    monkeypatch.setattr(readback, "_dump", lambda *args: iter(dumped))
    decoded: List[bytes] = []
    real = readback.ex.verdict_of
    monkeypatch.setattr(readback.ex, "verdict_of", lambda data: decoded.append(data) or real(data))
    got = list(readback._elements(None, 2, spec))  # type: ignore[arg-type]  # _dump is replaced
    assert got == elements
    assert len(decoded) == 3
