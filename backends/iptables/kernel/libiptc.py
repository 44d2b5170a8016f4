"""The libiptc writer: libiptc in process, through python-iptables (``iptc``), fenced.

python-iptables' traps, and what this module does about each:

- **Process-wide table singletons** (``iptc.Table("nat")`` is cached per process, and a cached handle
  keeps the table as it was when first read, in the namespace it was opened in): we never use
  ``iptc.Table``.  Each write opens its own libiptc handle with ``iptc_init`` and frees it after.
- **Autocommit on by default** (every call commits a whole table: thousands of kernel uploads): no
  ``Table`` means no autocommit; we call ``iptc_commit`` once per table, which swaps it atomically.
- **Refreshing after another writer**: libiptc works on a copy of the table taken at ``iptc_init``;
  committing an old copy would undo other programs' changes.  A handle is opened right before it is
  changed and freed right after the commit, so the copy is never older than one sync.
- **nf_tables hosts**: libiptc only reaches the legacy tables; on a node whose ``iptables`` is the
  nf_tables variant it would write rules nobody sees.  :class:`LibiptcWriter` refuses to run there.
- **One family per extension library**: an extension's ``.so`` registers its targets for the family
  that is current when it is first loaded; ``libxt_NAT.so`` loaded for IPv4 never offers DNAT to
  IPv6 in the same process.  :func:`_load_for_family` loads a private copy while the other family is
  current (its constructor registers again), once per process (:func:`_prepare_targets`).
- **Every target lookup opens every table**: ``Target`` asks ``rule.tables`` (the singletons, with
  autocommit on) whether its name is a chain.  Our rule classes answer with no tables; jumps to our
  chains are written as standard targets by name (:meth:`RuleBuilder.build_slow`).
- **Per-rule cost** (~390 µs to build a rule object, docs/performance.md): rule blobs are built from
  templates.  For each rule *shape* (the arguments with addresses, ports, comments, odds and names
  blanked) python-iptables builds one template with sentinel values; each rule is then the template's
  bytes with its own values patched in.  The first rule of every shape is also built the slow way and
  compared byte for byte; a shape that does not match is built the slow way from then on.
"""

from __future__ import annotations

import ctypes as ct
import ipaddress
import logging
import math
import os
import shutil
import struct
import tempfile
from typing import AbstractSet, Any, Callable, Dict, List, Optional, Sequence, Tuple

from netproxy.backends.base import BackendUnavailable, SyncError
from netproxy.backends.iptables.assemble import TABLES
from netproxy.backends.iptables.diff import KernelTable, TableChange
from netproxy.backends.iptables.kernel import Counts, blob_counts, legacy_header
from netproxy.backends.iptables.kernel.restore import RestoreTools
from netproxy.backends.iptables.kernel.stamp import Expected, Stamp, fingerprint, read_table
from netproxy.backends.iptables.payload import rule_line
from netproxy.backends.iptables.words import options
from netproxy.backends.iptables.xtlock import XtablesLock

log = logging.getLogger(__name__)

COMMENT_LEN = 256  # XT_MAX_COMMENT_LEN
TARGET_NAME_LEN = 29  # XT_EXTENSION_MAXNAMELEN

_S_COMMENT = "npx-sentinel-comment-7f3a9c"
_S_CHAIN = "KUBE-NPX-SENTINEL-9E1"
_S_PORT = 0xC3A7
_S_PORT_HI = 0xC3B9
_S_PROB = "0.3141592653"
_S_DEST = {4: ipaddress.ip_address("198.51.100.213"), 6: ipaddress.ip_address("2001:db8:7a3c::c3a5")}
_S_DEST_PORT = 0xA7C5


def _iptc(family: int) -> Tuple[Any, Any, Any]:
    """(libiptc call table, Rule class, entry struct) — imported late: loading iptc loads kernel modules."""
    try:
        if family == 4:
            from iptc.ip4tc import Rule as IRule
            from iptc.ip4tc import ipt_entry, iptc

            call, base, entry = iptc, IRule, ipt_entry
        else:
            from iptc.ip6tc import Rule6, ip6t_entry, ip6tc

            call, base, entry = ip6tc, Rule6, ip6t_entry
    except Exception as exc:  # noqa: BLE001 - OSError without libiptc, iptc's XTablesError without
        # ldconfig or an xtables extensions directory: all mean "not usable here", never a crash.
        raise BackendUnavailable("python-iptables (libiptc) is not usable here", detail=str(exc)) from exc
    _prepare_targets()

    class NoTablesRule(base):  # type: ignore[misc,valid-type]
        """A rule that never opens python-iptables' table singletons (see the module docstring)."""

        tables: List[Any] = []

    return call, NoTablesRule, entry


_MULTI_FAMILY_TARGETS = ("DNAT",)
_prepared = False


def _prepare_targets() -> None:
    """Make the NAT targets known to both families, once per process, IPv4 first.

    A failed lookup for the second family makes xtables stop looking for good, so the second family
    loads its private copy *before* its first lookup.
    """
    global _prepared
    if _prepared:
        return
    from iptc import xtables as xt_mod

    x4 = xt_mod.xtables(xt_mod.NFPROTO_IPV4)
    x6 = xt_mod.xtables(xt_mod.NFPROTO_IPV6)
    for name in _MULTI_FAMILY_TARGETS:
        if not x4.find_target(name):
            raise BackendUnavailable(f"iptables extension {name} is not available")
        shared = os.path.join(xt_mod._xtables_libdir, f"libxt_{name}.so")
        if not os.path.exists(shared):
            # iptables < 1.8.8 (Debian 11's 1.8.7) ships one library per family (libipt_DNAT.so,
            # libip6t_DNAT.so) that xtables finds on its own: no private copy needed.
            if not x6.find_target(name):
                raise BackendUnavailable(f"iptables extension {name} is not available for IPv6")
            continue
        real = os.path.realpath(shared)
        with tempfile.TemporaryDirectory(prefix="netproxy-xt-") as tmp:
            copy = os.path.join(tmp, f"libxt_{name}_ipv6.so")
            shutil.copyfile(real, copy)
            xt_mod.xtables._xtables_set_nfproto(xt_mod.NFPROTO_IPV6)
            ct.CDLL(copy, mode=ct.RTLD_GLOBAL)  # its constructor registers the IPv6 targets now
        if not x6.find_target(name):
            raise BackendUnavailable(f"iptables extension {name} is not available for IPv6")
    _prepared = True


def _port_range(value: str) -> Tuple[int, int]:
    """``"80"`` or ``"30720:30975"`` → (first, last): what xt_tcp/xt_udp store for ``--dport``."""
    lo, _, hi = value.partition(":")
    return int(lo), int(hi or lo)


def _dest_port(value: str) -> Tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


class _Shape:
    """One template blob and where each variable value goes in it."""

    def __init__(self, blob: bytes, fields: List[Tuple[str, Tuple[int, ...]]], family: int) -> None:
        self.blob = blob
        self.fields = fields
        self.family = family
        self.checked = False
        self.slow = False


class RuleBuilder:
    """Argument lists → rule blobs for one family, fast."""

    def __init__(self, family: int) -> None:
        self.family = family
        _, self._rule_cls, entry = _iptc(family)
        ip_field = "ip" if family == 4 else "ipv6"
        ip_struct = getattr(entry, ip_field)
        self._ip_off = ip_struct.offset
        self._ip_cls = {f[0]: f[1] for f in entry._fields_}[ip_field]
        self._shapes: Dict[Tuple[str, ...], _Shape] = {}

    def forget_sets(self) -> None:
        """Drop the templates of rules that name an ipset: a blob holds the set's kernel *index*,
        which changes when sets are destroyed and made again between writes (``sets.py``).  Within
        one write the sets stay put, so the templates are made again once per write."""
        for key in [k for k in self._shapes if "--match-set" in k or "--add-set" in k]:
            del self._shapes[key]

    # -- python-iptables, the slow and authoritative way -----------------------------------------

    def build_slow(self, args: Sequence[str]) -> bytes:
        """Build a rule through python-iptables from an argument list (the same words iptables takes)."""
        rule = self._rule_cls()
        module: Any = None
        jump_chain: Optional[str] = None
        for opt in options(args):
            prefix = "!" if opt.negated else ""
            if opt.name in ("-s", "-d"):
                setattr(rule, "src" if opt.name == "-s" else "dst", prefix + opt.value)
            elif opt.name == "-p":
                rule.protocol = prefix + opt.value
            elif opt.name == "-i":  # --detect-local-mode's interface ("br0", or a prefix "veth+")
                rule.in_interface = prefix + opt.value
            elif opt.name == "-m":
                module = rule.create_match(opt.value)
            elif opt.name == "-j" and opt.value.startswith("KUBE-"):
                # python-iptables decides "is this a chain?" by opening every table through its
                # process-wide singletons (with autocommit on). A jump is the standard target with
                # the chain's name in it: build a RETURN and put the name in below.
                jump_chain = opt.value
                module = rule.create_target("RETURN")
            elif opt.name == "-j":
                module = rule.create_target(opt.value)
            elif opt.name.startswith("--") and module is not None:
                if len(opt.values) > 1:  # --match-set NAME src,dst,dst
                    module.set_parameter(opt.name[2:], ([prefix] if prefix else []) + list(opt.values))
                else:
                    module.set_parameter(opt.name[2:], prefix + opt.value)
            else:
                raise ValueError(f"cannot build rule {' '.join(args)!r}: unexpected {opt.name!r}")
        rule.final_check()
        buf = rule.rule
        blob = bytearray(ct.string_at(ct.addressof(buf), rule.entry.next_offset))
        if jump_chain is not None:
            name_off = rule.entry.target_offset + 2  # xt_entry_target.u.user: u16 size, then the name
            blob[name_off:name_off + TARGET_NAME_LEN] = jump_chain.encode().ljust(TARGET_NAME_LEN, b"\0")
        return bytes(blob)

    # -- templates -------------------------------------------------------------------------------

    def _shape_of(self, args: Sequence[str]) -> Tuple[Tuple[str, ...], List[Tuple[str, str]]]:
        """(shape key, [(kind, value)]) — the rule with its variable values replaced by kind tags."""
        key: List[str] = []
        values: List[Tuple[str, str]] = []
        prev = ""
        for arg in args:
            kind = None
            if prev in ("-s", "-d"):
                net = ipaddress.ip_network(arg, strict=False)
                kind = "src" if prev == "-s" else "dst"
                key.append(f"<{kind}/{net.prefixlen}>")
            elif prev == "--comment":
                kind = "comment"
            elif prev == "--dport":
                # A range (the NodePort tree's "LO:HI") is its own shape: its sentinel is a pair.
                kind = "dports" if ":" in arg else "dport"
            elif prev == "--probability":
                kind = "prob"
            elif prev == "--to-destination":
                kind = "dest"
            elif prev == "-j" and arg.startswith("KUBE-"):
                kind = "chain"
            if kind is None:
                key.append(arg)
            else:
                if kind not in ("src", "dst"):
                    key.append(f"<{kind}>")
                values.append((kind, arg))
            prev = arg
        return tuple(key), values

    def _sentinel(self, kind: str, value: str) -> str:
        if kind in ("src", "dst"):
            prefix = ipaddress.ip_network(value, strict=False).prefixlen
            base = _S_DEST[self.family]
            return str(ipaddress.ip_network(f"{base}/{prefix}", strict=False))
        dest = _S_DEST[self.family]
        return {"comment": _S_COMMENT, "dport": str(_S_PORT), "dports": f"{_S_PORT}:{_S_PORT_HI}",
                "prob": _S_PROB, "chain": _S_CHAIN,
                "dest": f"{dest}:{_S_DEST_PORT}" if self.family == 4 else f"[{dest}]:{_S_DEST_PORT}"}[kind]

    def _encoded(self, kind: str, value: str) -> List[Tuple[str, bytes]]:
        """(field, bytes) that a value of this kind leaves in a blob; used to find the sentinels."""
        if kind in ("comment", "chain"):
            return [(kind, value.encode() + b"\0")]
        if kind in ("dport", "dports"):
            return [(kind, struct.pack("=HH", *_port_range(value)))]
        if kind == "prob":
            return [(kind, struct.pack("=I", _probability_u32(value)))]
        if kind == "dest":
            host, port = _dest_port(value)
            return [("dest_addr", ipaddress.ip_address(host).packed), ("dest_port", struct.pack(">H", port))]
        raise KeyError(kind)

    def _make_shape(self, args: Sequence[str], values: List[Tuple[str, str]]) -> _Shape:
        sentinel_args = list(args)
        sentinels = iter(self._sentinel(k, v) for k, v in values)
        prev = ""
        for i, arg in enumerate(args):
            if prev in ("-s", "-d", "--comment", "--dport", "--probability", "--to-destination") or (
                    prev == "-j" and arg.startswith("KUBE-")):
                sentinel_args[i] = next(sentinels)
            prev = arg
        blob = self.build_slow(sentinel_args)
        fields: List[Tuple[str, Tuple[int, ...]]] = []
        seen_kinds = set()
        for kind, _ in values:
            if kind in seen_kinds or kind in ("src", "dst"):
                continue
            seen_kinds.add(kind)
            for name, needle in self._encoded(kind, self._sentinel(kind, "")):
                offsets = _find_all(blob, needle)
                if not offsets:
                    raise ValueError(f"sentinel for {name} not found in template")
                fields.append((name, tuple(offsets)))
        return _Shape(blob, fields, self.family)

    def build(self, args: Sequence[str]) -> bytes:
        key, values = self._shape_of(args)
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = self._make_shape(args, values)
        if shape.slow:
            return self.build_slow(args)
        blob = self._patch(shape, values)
        if not shape.checked:
            shape.checked = True
            slow = self.build_slow(args)
            if slow != blob:
                log.warning("libiptc template for %r did not match; building that shape the slow way", key)
                shape.slow = True
                return slow
        return blob

    def _patch(self, shape: _Shape, values: List[Tuple[str, str]]) -> bytes:
        buf = bytearray(shape.blob)
        by_kind = dict(values)
        for name, offsets in shape.fields:
            value = by_kind[name.split("_")[0]]
            if name == "comment":
                data = value.encode()[:COMMENT_LEN - 1].ljust(COMMENT_LEN, b"\0")
            elif name == "chain":
                data = value.encode().ljust(TARGET_NAME_LEN, b"\0")
            elif name in ("dport", "dports"):
                data = struct.pack("=HH", *_port_range(value))
            elif name == "prob":
                data = struct.pack("=I", _probability_u32(value))
            elif name == "dest_addr":
                data = ipaddress.ip_address(_dest_port(value)[0]).packed
            elif name == "dest_port":
                data = struct.pack(">H", _dest_port(value)[1])
            else:  # pragma: no cover - _encoded only makes the names above
                raise KeyError(name)
            for off in offsets:
                buf[off:off + len(data)] = data
        for kind in ("src", "dst"):
            if kind in by_kind:
                self._patch_addr(buf, kind, by_kind[kind])
        return bytes(buf)

    def _patch_addr(self, buf: bytearray, kind: str, value: str) -> None:
        net = ipaddress.ip_network(value, strict=False)
        addr_off = self._ip_off + getattr(self._ip_cls, kind).offset
        mask_off = self._ip_off + getattr(self._ip_cls, "smsk" if kind == "src" else "dmsk").offset
        buf[addr_off:addr_off + len(net.network_address.packed)] = net.network_address.packed
        buf[mask_off:mask_off + len(net.netmask.packed)] = net.netmask.packed


def _probability_u32(text: str) -> int:
    """What libxt_statistic stores: lround(0x80000000 * p) (round half away from zero)."""
    return int(math.floor(0x80000000 * float(text) + 0.5))


def _find_all(blob: bytes, needle: bytes) -> List[int]:
    out = []
    start = blob.find(needle)
    while start >= 0:
        out.append(start)
        start = blob.find(needle, start + 1)
    return out


_BUILTIN = {"nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"), "filter": ("INPUT", "FORWARD", "OUTPUT")}


def _open(family: int, table: str) -> Tuple[Any, Any]:
    call = _iptc(family)[0]
    handle = call.iptc_init(table.encode())
    if not handle:
        raise SyncError(f"libiptc cannot read the IPv{family} {table} table", detail=_strerror(call))
    return call, handle


def load() -> None:
    """Import python-iptables and prepare its extensions (raises BackendUnavailable when unusable)."""
    _iptc(4)


class LibiptcWriter:
    """``--iptables-writer libiptc``: the same changes as the restore writer, one commit per table."""

    name = "libiptc"

    def __init__(self, flavour: str, lock: Optional[XtablesLock] = None) -> None:
        self.flavour = flavour
        self._builders: Dict[int, RuleBuilder] = {}
        self.lock = lock if lock is not None else XtablesLock(5.0)
        self.tools = RestoreTools(flavour, self.lock)
        """The tables as text (cleanup): iptables-legacy-save/-restore, beside every legacy libiptc."""

    def _refuse_nft(self) -> None:
        if self.flavour == "nft":
            raise BackendUnavailable(
                "the libiptc writer only reaches legacy iptables tables, and this node's iptables is the "
                "nf_tables variant: rules written this way would not be shown by iptables; "
                "use --iptables-writer restore")

    def probe(self) -> None:
        self._refuse_nft()
        load()

    def builder(self, family: int) -> RuleBuilder:
        if family not in self._builders:
            self._builders[family] = RuleBuilder(family)
        return self._builders[family]

    def read(self, family: int, fingerprint: bool = False) -> Dict[str, KernelTable]:
        self._refuse_nft()
        # The table blob read (stamp.chains_and_jumps): one getsockopt per table, no libiptc handle.
        tables: Dict[str, KernelTable] = {}
        try:
            for table in TABLES:
                got = read_table(family, table, fingerprint)
                tables[table] = KernelTable(frozenset(got.names), frozenset(got.jumps), got.fingerprint, got.header)
        except (OSError, ValueError) as exc:
            raise BackendUnavailable(f"cannot read the IPv{family} legacy tables", detail=str(exc)) from exc
        return tables

    def stamp(self, families: Sequence[int], expect: Optional[Expected] = None) -> Optional[Stamp]:
        return fingerprint(families, TABLES, expect)

    def header(self, family: int, table: str) -> Optional[bytes]:
        return legacy_header(family, table)

    def counts(self, family: int, table: str) -> Counts:
        self._refuse_nft()
        return blob_counts(family, table)

    def own_pids(self) -> AbstractSet[int]:
        return set()  # commits in this process; legacy tables send no nf_tables notifications anyway

    def save(self, family: int, table: str) -> str:
        text: str = self.tools.save(family, table)
        return text

    def restore(self, family: int, payload: str) -> None:
        self._refuse_nft()
        self.tools.restore(family, payload)

    def apply(self, family: int, changes: List[TableChange],
              before_commit: Optional[Callable[[], None]] = None,
              meanwhile: Optional[Callable[[], None]] = None) -> int:
        self._refuse_nft()
        builder = self.builder(family)
        builder.forget_sets()
        total = 0
        for change in changes:
            total += self._apply_table(family, builder, change, before_commit)
            before_commit = None
        if meanwhile is not None:
            meanwhile()  # the commits are this process's own calls: nothing to overlap with
        return total

    def _apply_table(self, family: int, builder: RuleBuilder, change: TableChange,
                     before_commit: Optional[Callable[[], None]] = None) -> int:
        # A fresh handle per write: libiptc commits the copy it read, so an old copy would undo other
        # programs' changes made since.  For the same reason the xtables lock is held from the copy
        # to the commit, as iptables holds it: without it a rule another program adds in between is
        # silently dropped by our commit (or ours by theirs).
        with self.lock.hold():
            return self._apply_locked(family, builder, change, before_commit)

    def _apply_locked(self, family: int, builder: RuleBuilder, change: TableChange,
                      before_commit: Optional[Callable[[], None]]) -> int:
        call, handle = _open(family, change.table)
        total = 0
        current = ""
        try:
            for chain in list(change.write) + change.delete:
                current = f":{chain}"
                name = chain.encode()
                if call.iptc_is_chain(name, handle):
                    ok = call.iptc_flush_entries(name, handle)
                elif chain in change.write:
                    ok = call.iptc_create_chain(name, handle)
                else:
                    continue
                _check(ok, call, current)
            for chain, rules in change.write.items():
                name = chain.encode()
                for rule in rules:
                    blob = builder.build(rule)
                    total += len(blob)
                    current = rule_line("-A", chain, rule)
                    _check(call.iptc_append_entry(name, blob, handle), call, current)
            for hook, rule in change.jumps:
                current = rule_line("-I", f"{hook} 1", rule)
                _check(call.iptc_insert_entry(hook.encode(), builder.build(rule), 0, handle), call, current)
            for chain in change.delete:
                current = f"-X {chain}"
                if call.iptc_is_chain(chain.encode(), handle):
                    _check(call.iptc_delete_chain(chain.encode(), handle), call, current)
            current = "COMMIT"
            if before_commit is not None:
                before_commit()
            _check(call.iptc_commit(handle), call, f"COMMIT ({change.table})")
        except (ValueError, KeyError) as exc:
            raise SyncError("libiptc writer could not build a rule", line=current, detail=str(exc)) from exc
        finally:
            call.iptc_free(handle)
        return total


def _strerror(call: Any) -> str:
    errno = ct.get_errno() or _libc_errno()
    text = call.iptc_strerror(errno)
    return text.decode() if isinstance(text, bytes) else str(text)


def _libc_errno() -> int:
    try:
        from iptc.ip4tc import _get_errno_loc

        return int(_get_errno_loc()[0])
    except (ImportError, OSError, AttributeError):
        return 0


def _check(ok: int, call: Any, line: str) -> None:
    if ok != 1:
        detail = _strerror(call)
        log.error("libiptc refused %r: %s", line, detail)
        raise SyncError("libiptc refused the write", line=line, detail=detail)
