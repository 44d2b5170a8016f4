"""The legacy-table fingerprint's entry walk (backends/iptables/stamp.py), without a kernel."""

from __future__ import annotations

import struct
import sys

import pytest

from netproxy.backends.iptables import stamp


@pytest.mark.parametrize("family", [4, 6])
def test_offsets_are_the_kernel_structs(family: int) -> None:
    # python-iptables mirrors struct ipt_entry / ip6t_entry with ctypes: the walk must agree with it.
    if family == 4:
        from iptc.ip4tc import ipt_entry as entry
    else:
        from iptc.ip6tc import ip6t_entry as entry
    layout = stamp.LAYOUTS[family]
    assert entry.next_offset.offset == layout.next_offset
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
    stamp.mask(buf, family, start)
    return bytes(buf)


def test_a_corrupt_walk_is_refused_not_looped() -> None:
    blob = bytearray(_entry(4, 200, 1, 7))
    blob[90:92] = struct.pack("=H", 0)
    with pytest.raises(ValueError):
        stamp.mask(blob, 4)
