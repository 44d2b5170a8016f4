"""The legacy-table fingerprint's entry walk (backends/iptables/kernel/stamp.py), without a kernel."""

from __future__ import annotations

import ctypes
import random
import struct
import sys
from typing import Dict, List, Tuple

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
    # The stamp's value: the digest, then the header of the same read (what a new process compares first).
    assert stamp.table_fingerprint(family, "nat").header == read.header
    value = stamp.fingerprint([family], ["nat"])[(family, "nat")]  # type: ignore[index]
    assert value == stamp.stamp_value(before, read.header) and stamp.header_of(value) == read.header
    entries[1] = _chain_entry(family, e, b"SNAT")
    served[0] = blob(7)
    assert stamp.read_table(family, "nat", fingerprint=True).fingerprint != before


def _reference_mask(blob: bytearray, family: int) -> Tuple[int, Dict[str, int]]:
    """The walk as first written (one entry at a time, the counts kept as it goes): the spec the
    faster :func:`stamp.mask` must match byte for byte and count for count."""
    layout = stamp.LAYOUTS[family]
    lo, hi = layout.volatile
    chains: Dict[str, int] = {}
    chain, entries, at = "", 0, 0
    while at < len(blob):
        entries += 1
        step = int.from_bytes(blob[at + layout.next_offset:at + layout.next_offset + 2], sys.byteorder)
        target = at + int.from_bytes(blob[at + layout.target_offset:at + layout.target_offset + 2], sys.byteorder)
        if bytes(blob[target + 2:target + 31]).rstrip(b"\0") == b"ERROR":
            chain = bytes(blob[target + 32:at + step]).split(b"\0", 1)[0].decode(errors="replace")
            chains[chain] = -1
        elif chain:
            chains[chain] += 1
        blob[at + lo:at + hi] = bytes(hi - lo)
        at += step
    chains.pop("ERROR", None)
    return entries, chains


def _random_table(family: int, rng: random.Random, count: int) -> bytes:
    """Entries of random sizes, counters and targets: rules, RETURN tails, chain heads (some with a
    name seen before, an empty one, an ``ERROR`` name with more after it, which is no head)."""
    least = stamp.LAYOUTS[family].entry_size
    names = [b"KUBE-A", b"KUBE-B", b"KUBE-SVC-X", b"", b"ERROR"]
    out = []
    for _ in range(count):
        kind = rng.random()
        if kind < 0.2:
            target, data = b"ERROR", rng.choice(names[:-1])
        elif kind < 0.25:
            target, data = b"ERROR\0\0x", b"KUBE-NOT-A-HEAD"  # a name that only starts with ERROR
        else:
            target, data = rng.choice([b"", b"DNAT", b"MARK", b"ERRORS"]), bytes(rng.randrange(256) for _ in range(8))
        raw = bytearray(_chain_entry(family, least + 32 + 8 * rng.randrange(4, 12), target, data))
        lo, hi = stamp.LAYOUTS[family].volatile
        raw[lo:hi] = bytes(rng.randrange(256) for _ in range(hi - lo))
        out.append(bytes(raw))
    out.append(_chain_entry(family, least + 64, b"ERROR", b"ERROR"))
    return b"".join(out)


@pytest.mark.parametrize("family", [4, 6])
@pytest.mark.parametrize("seed", range(20))
def test_mask_matches_the_entry_by_entry_walk(family: int, seed: int) -> None:
    rng = random.Random(seed)
    blob = _random_table(family, rng, rng.randrange(1, 300))
    fast, slow = bytearray(blob), bytearray(blob)
    got = stamp.mask(fast, family)
    want = _reference_mask(slow, family)
    assert got == want and list(got[1]) == list(want[1])  # same counts, same chain order
    assert fast == slow  # the same bytes masked: the same digest


@pytest.mark.parametrize("family", [4, 6])
@pytest.mark.parametrize("seed", range(10))
def test_read_table_names_jumps_and_fingerprint_on_random_tables(family: int, seed: int,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Built-in chains (hook entries, policies) then random user chains: the names, the built-in
    chains' jumps (by extension name, or by offset to a chain's first entry) and the fingerprint of
    read_table are what a plain reading of the same blob gives, and the fingerprint is
    table_fingerprint's."""
    rng = random.Random(seed)
    layout = stamp.LAYOUTS[family]
    least, size = layout.entry_size, layout.entry_size + 40
    # A kernel's user part always opens with a chain head.
    user = _chain_entry(family, least + 64, b"ERROR", b"KUBE-FIRST") + _random_table(family, rng, rng.randrange(1, 200))
    heads: Dict[str, int] = {}  # user chain → offset of its first entry, inside the user part
    for at in _walk(user, layout):
        step = int.from_bytes(user[at + layout.next_offset:at + layout.next_offset + 2], sys.byteorder)
        if user[at + least + 2:at + least + 8] == b"ERROR\0":
            name = user[at + least + 32:at + step].split(b"\0", 1)[0].decode()
            if name not in ("ERROR", ""):
                heads[name] = at + step
    # Built-in chains: fixed-size entries, so every offset is known before writing them.
    plan: List[Tuple[int, object]] = []  # (hook, extension name or user chain or None for the policy)
    hooks, policies = [0] * 5, [0] * 5
    for h in (0, 2, 4):  # PREROUTING, FORWARD, POSTROUTING
        hooks[h] = len(plan) * size
        for _ in range(rng.randrange(0, 4)):
            plan.append((h, rng.choice(sorted(heads)) if rng.random() < 0.5 else rng.choice([b"DNAT", b"MASQ"])))
        policies[h] = len(plan) * size
        plan.append((h, None))
    builtin_size = len(plan) * size
    body, want_jumps = b"", set()
    for h, what in plan:
        if what is None:
            body += _chain_entry(family, size, b"", struct.pack("=i", -2))  # ACCEPT policy: no jump
        elif isinstance(what, bytes):
            body += _chain_entry(family, size, what)
            want_jumps.add((stamp.HOOKS[h], what.decode()))
        else:
            body += _chain_entry(family, size, b"", struct.pack("=i", builtin_size + heads[str(what)]))
            want_jumps.add((stamp.HOOKS[h], str(what)))
    blob = body + user
    entries = len(plan) + len(_walk(user, layout))
    head = (b"nat".ljust(32, b"\0"), 0b10101, *hooks, *policies, entries, len(blob))
    monkeypatch.setattr(stamp, "_blob", lambda family, table: (head, bytearray(stamp._ENTRIES_HEADER) + blob))
    read = stamp.read_table(family, "nat", fingerprint=True)
    assert read.names == ["PREROUTING", "FORWARD", "POSTROUTING"] + [
        n for n in _head_names(user, layout) if n != "ERROR"]
    assert read.jumps == want_jumps
    assert read.fingerprint == stamp.table_fingerprint(family, "nat").digest


def _walk(blob: bytes, layout: stamp._Layout) -> List[int]:
    out, at = [], 0
    while at < len(blob):
        out.append(at)
        at += int.from_bytes(blob[at + layout.next_offset:at + layout.next_offset + 2], sys.byteorder)
    return out


def _head_names(blob: bytes, layout: stamp._Layout) -> List[str]:
    """read_table's chain heads: a target named ``ERROR`` (whatever follows its NUL)."""
    names = []
    for at in _walk(blob, layout):
        size = int.from_bytes(blob[at + layout.next_offset:at + layout.next_offset + 2], sys.byteorder)
        target = at + layout.entry_size
        if blob[target + 2:target + 8] == b"ERROR\0":
            names.append(blob[target + 32:at + size].split(b"\0", 1)[0].decode(errors="replace"))
    return names


@pytest.mark.parametrize("family", [4, 6])
def test_read_table_refuses_a_target_past_the_blob_as_a_corrupt_walk(family: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer falls back to iptables-save on a ValueError from the blob's walk: an entry whose
    target offset points past the end of the copy is one (not an IndexError that fails the sync)."""
    layout = stamp.LAYOUTS[family]
    last = bytearray(_chain_entry(family, layout.entry_size + 64, b"ERROR", b"ERROR"))
    last[layout.target_offset:layout.target_offset + 2] = (60000).to_bytes(2, sys.byteorder)
    blob = _chain_entry(family, layout.entry_size + 64, b"ERROR", b"KUBE-A") + bytes(last)
    head = (b"nat".ljust(32, b"\0"), 0, *([0] * 10), 2, len(blob))
    monkeypatch.setattr(stamp, "_blob", lambda family, table: (head, bytearray(stamp._ENTRIES_HEADER) + blob))
    with pytest.raises(ValueError, match="past the table's end"):
        stamp.read_table(family, "nat", fingerprint=True)


@pytest.mark.parametrize("family", [4, 6])
def test_an_odd_entry_size_is_refused(family: int) -> None:
    """The walk reads offsets as aligned u16 words: the kernel's entries are 8-byte aligned, and a
    size that would put the next entry at an odd offset is refused rather than read askew."""
    layout = stamp.LAYOUTS[family]
    blob = bytearray(_chain_entry(family, layout.entry_size + 65, b"ERROR", b"KUBE-A")
                     + _chain_entry(family, layout.entry_size + 64, b"ERROR", b"ERROR"))
    with pytest.raises(ValueError, match="next_offset"):
        stamp.mask(blob, family)
    with pytest.raises(ValueError, match="odd offset"):
        stamp.mask(bytearray(1) + blob, family, 1)
