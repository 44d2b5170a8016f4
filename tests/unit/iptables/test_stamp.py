"""The legacy-table fingerprint's entry walk (backends/iptables/kernel/stamp.py), without a kernel."""

from __future__ import annotations

import ctypes
import struct
import sys

import pytest

from netproxy.backends.iptables.kernel import stamp


@pytest.mark.parametrize("family", [4, 6])
def test_offsets_are_the_kernel_structs(family: int) -> None:
    # python-iptables mirrors struct ipt_entry / ip6t_entry with ctypes: the walk must agree with it.
    if family == 4:
        from iptc.ip4tc import ipt_entry as entry
    else:
        from iptc.ip6tc import ip6t_entry as entry
    layout = stamp.LAYOUTS[family]
    assert entry.next_offset.offset == layout.next_offset
    assert entry.target_offset.offset == layout.target_offset
    assert ctypes.sizeof(entry) == layout.entry_size
    assert entry.comefrom.offset == layout.volatile[0]
    assert entry.counters.offset + entry.counters.size == layout.volatile[1]


def _entry(family: int, size: int, fill: int, counters: int) -> bytes:
    layout = stamp.LAYOUTS[family]
    raw = bytearray([fill]) * size
    raw[layout.next_offset:layout.next_offset + 2] = size.to_bytes(2, sys.byteorder)
    start, end = layout.volatile
    raw[start:end] = bytes([counters]) * (end - start)
    return bytes(raw)


@pytest.mark.parametrize("family", [4, 6])
def test_mask_zeroes_counters_and_comefrom_of_every_entry_only(family: int) -> None:
    blob = _entry(family, 200, 1, 7) + _entry(family, 240, 2, 9) + _entry(family, 184, 3, 5)
    again = _entry(family, 200, 1, 0x55) + _entry(family, 240, 2, 0x66) + _entry(family, 184, 3, 0x77)
    assert masked(blob, family) == masked(again, family)  # only counters differ: same
    start, end = stamp.LAYOUTS[family].volatile
    out = masked(blob, family)
    for at in (0, 200, 440):
        assert out[at + start:at + end] == bytes(end - start)
    changed = _entry(family, 200, 1, 7) + _entry(family, 240, 4, 9) + _entry(family, 184, 3, 5)
    assert masked(changed, family) != out  # anything else differing: a different fingerprint
    header = b"h" * 40  # the walk can start after a header, which it leaves alone
    assert masked(header + blob, family, 40) == header + out


def masked(blob: bytes, family: int, start: int = 0) -> bytes:
    buf = bytearray(blob)
    entries, _ = stamp.mask(buf, family, start)
    assert entries == 3
    return bytes(buf)


@pytest.mark.parametrize("bad", [0, 100, 300])  # zero, shorter than an entry, past the end
def test_a_corrupt_walk_is_refused_not_looped(bad: int) -> None:
    blob = bytearray(_entry(4, 200, 1, 7))
    blob[90:92] = struct.pack("=H", bad)
    with pytest.raises(ValueError):
        stamp.mask(blob, 4)


def test_getsockopt_structs_have_the_kernels_sizes() -> None:
    # struct ipt_getinfo: name[32], valid_hooks, hook_entry[5], underflow[5], num_entries, size.
    assert stamp._GETINFO.size == 84
    # struct ipt_get_entries: name[32], u32 size, then ipt_entry (8-byte aligned on 64-bit).
    import ctypes

    from iptc.ip4tc import ipt_entry
    assert ctypes.alignment(ipt_entry) == 8 and stamp._ENTRIES_HEADER == 40


def _chain_entry(family: int, size: int, target: bytes, data: bytes = b"") -> bytes:
    layout = stamp.LAYOUTS[family]
    raw = bytearray(size)
    raw[layout.next_offset:layout.next_offset + 2] = size.to_bytes(2, sys.byteorder)
    toff = layout.entry_size
    raw[layout.target_offset:layout.target_offset + 2] = toff.to_bytes(2, sys.byteorder)
    raw[toff + 2:toff + 2 + len(target)] = target
    raw[toff + 32:toff + 32 + len(data)] = data
    return bytes(raw)


@pytest.mark.parametrize("family", [4, 6])
def test_user_chains_rule_counts(family: int) -> None:
    e = stamp.LAYOUTS[family].entry_size + 64
    blob = (_chain_entry(family, e, b"") * 2  # built-in chain rules come first, in no user chain
            + _chain_entry(family, e, b"ERROR", b"KUBE-A") + _chain_entry(family, e, b"DNAT") * 3
            + _chain_entry(family, e, b"")  # KUBE-A's RETURN tail
            + _chain_entry(family, e, b"ERROR", b"KUBE-B") + _chain_entry(family, e, b"")
            + _chain_entry(family, e, b"ERROR", b"ERROR"))
    entries, chains = stamp.mask(bytearray(blob), family)
    assert entries == 10 and chains == {"KUBE-A": 3, "KUBE-B": 0}


@pytest.mark.parametrize("family", [4, 6])
def test_read_table_fingerprints_as_table_fingerprint_in_the_same_walk(family: int,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A new process checks its stamp with the fingerprint of the full sync's own read (adopt.py): it
    must be the very digest that table_fingerprint gave right after the previous process's write."""
    e = stamp.LAYOUTS[family].entry_size + 64
    entries = [_chain_entry(family, e, b"ERROR", b"KUBE-A"), _chain_entry(family, e, b"DNAT"),
               _chain_entry(family, e, b""), _chain_entry(family, e, b"ERROR", b"ERROR")]

    def blob(counters: int) -> bytearray:
        body = bytearray(b"".join(entries))
        start, end = stamp.LAYOUTS[family].volatile
        for at in range(0, len(body), e):
            body[at + start:at + end] = bytes([counters]) * (end - start)
        return bytearray(stamp._ENTRIES_HEADER) + body

    head = (b"nat".ljust(32, b"\0"), 0, *([0] * 10), len(entries), len(entries) * e)
    served = [blob(7)]
    monkeypatch.setattr(stamp, "_blob", lambda family, table: (head, bytearray(served[0])))
    before = stamp.table_fingerprint(family, "nat").digest
    served[0] = blob(0x55)  # traffic moved the counters since
    read = stamp.read_table(family, "nat", fingerprint=True)
    assert read.fingerprint == before and "KUBE-A" in read.names
    assert read.header == stamp._GETINFO.pack(*head)
    assert stamp.read_table(family, "nat").fingerprint is None  # not asked: no masking, no hashing
    entries[1] = _chain_entry(family, e, b"SNAT")
    served[0] = blob(7)
    assert stamp.read_table(family, "nat", fingerprint=True).fingerprint != before
