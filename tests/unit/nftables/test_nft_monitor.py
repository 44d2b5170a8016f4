"""Parsing the kernel's nftables change notifications (netlink datagrams built here byte by byte)."""

from __future__ import annotations

import struct

from netproxy.backends.nftables.monitor import NFNL_SUBSYS_NFTABLES, NFT_MSG_NEWGEN, scan

NFT_MSG_NEWSETELEM = 12
NFT_MSG_NEWRULE = 6


def _attr(kind: int, value: bytes) -> bytes:
    body = struct.pack("=HH", 4 + len(value), kind) + value
    return body + b"\0" * (-len(body) % 4)


def _msg(msg: int, family: int, *attrs: bytes) -> bytes:
    payload = struct.pack("=BBH", family, 0, 0) + b"".join(attrs)
    header = struct.pack("=IHHII", 16 + len(payload), (NFNL_SUBSYS_NFTABLES << 8) | msg, 0, 0, 0)
    return header + payload


def _elem(table: str, family: int = 2) -> bytes:
    return _msg(NFT_MSG_NEWSETELEM, family, _attr(1, table.encode() + b"\0"), _attr(2, b"service-ips\0"))


def _gen(gen: int) -> bytes:
    return _msg(NFT_MSG_NEWGEN, 0, _attr(1, struct.pack(">I", gen)), _attr(2, struct.pack(">I", 4242)))


def test_someone_elses_transaction_on_our_table_is_found() -> None:
    assert scan(_elem("netproxy") + _gen(7), own=set(), touched=False) == (True, False)


def test_our_own_transaction_is_not_reported() -> None:
    assert scan(_elem("netproxy") + _gen(7), own={7}, touched=False) == (False, False)


def test_other_tables_and_families_are_ignored() -> None:
    data = _elem("firewalld") + _gen(8) + _elem("netproxy", family=1) + _gen(9)  # inet netproxy: not ours
    assert scan(data, own=set(), touched=False) == (False, False)


def test_ip6_table_and_a_transaction_split_across_datagrams() -> None:
    found, open_touch = scan(_elem("netproxy", family=10), own=set(), touched=False)
    assert (found, open_touch) == (False, True)
    assert scan(_gen(11), own=set(), touched=open_touch) == (True, False)


def test_other_subsystems_and_garbage_do_not_break_the_scan() -> None:
    conntrack = struct.pack("=IHHII", 20, (1 << 8) | 0, 0, 0, 0) + b"\0" * 4
    truncated = struct.pack("=IHHII", 8, 0, 0, 0, 0)
    assert scan(conntrack + _elem("netproxy") + _gen(3) + truncated, own=set(), touched=False) == (True, False)
