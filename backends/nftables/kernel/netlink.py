"""The netlink writer (the default): each sync as one nf_tables batch, no text and no second parse.

:mod:`..encode` builds the messages, :mod:`.nlsocket` sends them with an ACK asked for each, so a
refusal names the object whose message failed, and the kernel applies the batch all or nothing.
Reads (which tables exist, the generation, the affinity sets and maps) are netlink dumps too.
"""

from __future__ import annotations

import logging
import socket
import struct
from typing import AbstractSet, Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple
from typing import Set as PySet

from netproxy.backends.base import BackendUnavailable, SyncError
from netproxy.backends.nftables import encode, names, serialise, wire
from netproxy.backends.nftables.kernel.nlsocket import NetlinkError, NlSocket
from netproxy.backends.nftables.monitor import Watched
from netproxy.backends.nftables.objects import ELEMENT_TYPES, Element, Set, Table
from netproxy.backends.nftables.serialise import Op

log = logging.getLogger(__name__)

_TYPE_NAMES = {7: "ipv4_addr", 8: "ipv6_addr", 12: "inet_proto", 13: "inet_service", 4: "integer", 19: "mark"}
_PROTO_NAMES = {6: "tcp", 17: "udp", 132: "sctp"}


def type_fields(type_id: int) -> List[str]:
    """The datatype names of a (concatenated) set key type id, six bits each."""
    out = []
    while type_id:
        out.append(_TYPE_NAMES.get(type_id & 0x3F, "integer"))
        type_id >>= 6
    return out[::-1]


def unpack(fields: Sequence[str], data: bytes) -> str:
    """nft value text of a packed key or value."""
    parts = []
    offset = 0
    single = len(fields) == 1
    for kind in fields:
        if kind == "ipv4_addr":
            parts.append(socket.inet_ntoa(data[offset:offset + 4]))
            offset += 4
        elif kind == "ipv6_addr":
            parts.append(socket.inet_ntop(socket.AF_INET6, data[offset:offset + 16]))
            offset += 16
        elif kind == "inet_service":
            parts.append(str(int.from_bytes(data[offset:offset + 2], "big")))
            offset += 2 if single else 4
        elif kind == "inet_proto":
            parts.append(_PROTO_NAMES.get(data[offset], str(data[offset])))
            offset += 1 if single else 4
        else:
            parts.append(str(struct.unpack_from("=I", data, offset)[0]))
            offset += 4
    return " . ".join(parts)


def _scan(ops: Sequence[Op]) -> Tuple[List[Op], PySet[Tuple[str, str]]]:
    """One walk of a batch: its table and set operations (what :meth:`NetlinkRunner._remember_sets`
    reads) and the (family, set) of its elements.  The two walks it replaces, each over every
    operation with a tuple per element, were 45 ms of a 10k-service write; a batch's elements come
    grouped by set, so a set is added once per group."""
    containers: List[Op] = []
    wanted: PySet[Tuple[str, str]] = set()
    last_set, last_family = None, None
    for op in ops:
        obj = op[2]
        if isinstance(obj, ELEMENT_TYPES):
            name = obj.set
            if name != last_set or op[1] != last_family:
                last_set, last_family = name, op[1]
                wanted.add((op[1], name))
        elif isinstance(obj, (Set, Table)):
            containers.append(op)
    return containers, wanted


def _data_value(nested: bytes) -> bytes:
    out: bytes = wire.attributes(nested).get(wire.DATA_VALUE, b"")
    return out


class NetlinkRunner:
    def __init__(self) -> None:
        try:
            self._sock = NlSocket()
        except OSError as exc:
            raise BackendUnavailable("no nf_tables netlink socket", detail=str(exc)) from exc
        self._sets: Dict[Tuple[str, str], Set] = {}
        """The sets this writer created and has not deleted: their types pack later elements."""
        self.notifications = Watched()

    def watch(self, on: bool) -> None:
        self.notifications.watch(on)

    def others_touched(self, own: AbstractSet[int]) -> Optional[bool]:
        touched: Optional[bool] = self.notifications.others_touched(own)
        return touched

    # --- writes ----------------------------------------------------------------------------------

    def apply(self, ops: Sequence[Op]) -> int:
        containers, wanted = _scan(ops)
        encoder = encode.Encoder(self._known_sets(containers, wanted))
        sources: List[Op] = []  # the operation each message came from, by index: to name a refused one
        written = [0]

        def bodies() -> Iterator[encode.Message]:
            # Encoded as the socket copies them into its buffers: no list of every message (nlsocket).
            for message, op in encoder.messages(ops):
                sources.append(op)
                written[0] += len(message[3])
                yield message

        before = self.generation()
        try:
            complete = self._sock.send_batch(bodies())
        except encode.EncodeError as exc:  # raised before anything is sent: the batch is encoded first
            raise SyncError("cannot encode the transaction", detail=str(exc)) from exc
        except NetlinkError as exc:
            line = None
            if 0 <= exc.seq < len(sources):
                verb, family, obj = sources[exc.seq]
                line = serialise.op_text(verb, family, obj)
            raise SyncError("the kernel refused the nftables batch", line=_shorten(line),
                            detail=f"{exc.strerror} (errno {exc.errno})") from exc
        except OSError as exc:
            raise SyncError("cannot send the nftables batch", detail=str(exc)) from exc
        if not complete:
            after = self.generation()
            if before is None or after != before + 1:
                self._sets.clear()
                raise SyncError("the kernel's answers to the batch were lost (ENOBUFS) and the generation "
                                f"did not move by one ({before} -> {after}): not known to be applied")
        self._remember_sets(containers)
        return written[0]

    def _remember_sets(self, containers: Sequence[Op]) -> None:
        for verb, family, obj in containers:
            if isinstance(obj, Set):
                if verb == "add":
                    self._sets[(family, obj.name)] = obj
                elif verb == "delete":
                    self._sets.pop((family, obj.name), None)
            elif isinstance(obj, Table) and verb == "delete":
                for key in [k for k in self._sets if k[0] == family]:
                    del self._sets[key]

    def _known_sets(self, containers: Sequence[Op], wanted: AbstractSet[Tuple[str, str]]) -> Dict[Tuple[str, str], Set]:
        """Sets whose elements the batch adds or deletes (``wanted``) without creating them (in
        ``containers``): their types, from the kernel."""
        created = {(f, o.name) for v, f, o in containers if isinstance(o, Set) and v == "add"}
        known: Dict[Tuple[str, str], Set] = {}
        for family, name in wanted - created:
            spec = self._sets.get((family, name)) or self._set_spec(family, name)
            if spec is not None:
                known[(family, name)] = spec
        return known

    def _set_spec(self, family: str, name: str) -> Optional[Set]:
        body = wire.string(wire.SET_TABLE, names.TABLE) + wire.string(wire.SET_NAME, name)
        try:
            attrs = self._sock.get(wire.GETSET, encode.FAMILIES[family], body)
        except NetlinkError:
            return None
        return _set_from_attrs(attrs)

    def delete_tables(self, table: str = names.TABLE) -> List[str]:
        """Delete the tables named ``table`` (netproxy's by default; ``netproxy migrate`` deletes
        kube-proxy's) of every family, in one batch: all or none."""
        if table == names.TABLE:
            self._sets.clear()
        ours = sorted(self.existing_tables(table))
        if ours:
            msgs = [(wire.DELTABLE, 0, encode.FAMILIES[f], wire.string(wire.TABLE_NAME, table)) for f in ours]
            try:
                self._sock.send_batch(msgs)
            except OSError as exc:
                raise SyncError(f"cannot delete the {table} tables", detail=str(exc)) from exc
        return [f"{fam} {table}" for fam in ours]

    # --- reads -----------------------------------------------------------------------------------

    def probe(self) -> None:
        if self.generation() is None:
            raise BackendUnavailable("cannot read the nftables generation over netlink (no nf_tables?)")

    def existing_tables(self, table: str = names.TABLE) -> FrozenSet[str]:
        """The families that have a table named ``table`` (netproxy's by default)."""
        found = set()
        for family, number in encode.FAMILIES.items():
            try:
                for attrs in self._sock.dump(wire.GETTABLE, number):
                    if wire.text(attrs.get(wire.TABLE_NAME, b"")) == table:
                        found.add(family)
            except NetlinkError as exc:
                raise SyncError("cannot list nftables tables", detail=str(exc)) from exc
        return frozenset(found)

    def generation(self) -> Optional[int]:
        try:
            attrs = self._sock.get(wire.GETGEN, socket.AF_UNSPEC)
        except OSError as exc:
            log.debug("cannot read the nftables generation: %s", exc)
            return None
        gen = attrs.get(wire.GEN_ID)
        return wire.be32(gen) if gen is not None else None

    def read_sets(self, family: str) -> List[Tuple[Set, List[Element]]]:
        out = []
        try:
            specs = [_set_from_attrs(a) for a in self._sock.dump(wire.GETSET, encode.FAMILIES[family],
                                                                 wire.string(wire.SET_TABLE, names.TABLE))]
        except NetlinkError as exc:
            if exc.errno == 2:
                return []
            raise SyncError("cannot list nftables sets", detail=str(exc)) from exc
        for spec in specs:
            if spec is not None and not spec.is_map:
                out.append((spec, self._elements(family, spec)))
        return out

    def read_elements(self, family: str, set_name: str) -> List[Element]:
        spec = self._set_spec(family, set_name)
        return [] if spec is None else self._elements(family, spec)

    def read_stamped(self, family: str, set_names: Sequence[str]) -> Dict[str, List[Element]]:
        from netproxy.backends.nftables.kernel import readback

        return readback.read_named(self._sock, family, set_names)

    def get_elements(self, family: str, set_name: str, keys: Sequence[str]) -> List[Element]:
        from netproxy.backends.nftables.kernel import readback

        return readback.get_elements(self._sock, family, set_name, keys)

    def chain_names(self, family: str) -> FrozenSet[str]:
        from netproxy.backends.nftables.kernel import readback

        return readback.chain_names(self._sock, family)

    def chain_uses(self, family: str) -> Dict[str, int]:
        from netproxy.backends.nftables.kernel import readback

        return readback.chain_uses(self._sock, family)

    def _elements(self, family: str, spec: Set) -> List[Element]:
        key_fields = spec.key_type.split(" . ")
        value_fields = spec.value_type.split(" . ") if spec.value_type not in (None, "verdict") else None
        body = wire.string(wire.SET_ELEM_LIST_TABLE, names.TABLE) + wire.string(wire.SET_ELEM_LIST_SET, spec.name)
        out = []
        try:
            for attrs in self._sock.dump(wire.GETSETELEM, encode.FAMILIES[family], body):
                nested = attrs.get(wire.SET_ELEM_LIST_ELEMENTS, b"")
                for _, raw in wire.attribute_list(nested):
                    e = wire.attributes(raw)
                    key = unpack(key_fields, _data_value(e.get(wire.ELEM_KEY, b"")))
                    value = unpack(value_fields, _data_value(e[wire.ELEM_DATA])) if value_fields and \
                        wire.ELEM_DATA in e else None
                    expires = wire.be64(e[wire.ELEM_EXPIRATION]) // 1000 if wire.ELEM_EXPIRATION in e else None
                    timeout = wire.be64(e[wire.ELEM_TIMEOUT]) // 1000 if wire.ELEM_TIMEOUT in e else None
                    out.append(Element(spec.name, key, value, expires=expires, timeout=timeout))
        except NetlinkError as exc:
            raise SyncError(f"cannot read the elements of {spec.name}", detail=str(exc)) from exc
        return out


def _set_from_attrs(attrs: Dict[int, bytes]) -> Optional[Set]:
    """A set as the kernel describes it (types by name from the type ids; typeof is not read back)."""
    if wire.SET_NAME not in attrs:
        return None
    flags = wire.be32(attrs.get(wire.SET_FLAGS, b"\0\0\0\0"))
    value: Optional[str] = None
    if flags & wire.SET_F_MAP:
        dtype = wire.be32(attrs.get(wire.SET_DATA_TYPE, b"\0\0\0\0"))
        value = "verdict" if dtype == wire.DATA_TYPE_VERDICT else " . ".join(type_fields(dtype))
    timeout = wire.be64(attrs[wire.SET_TIMEOUT]) // 1000 if wire.SET_TIMEOUT in attrs else None
    key = " . ".join(type_fields(wire.be32(attrs.get(wire.SET_KEY_TYPE, b"\0\0\0\0"))))
    return Set(wire.text(attrs[wire.SET_NAME]), key, value,
               flags=tuple(f for f, bit in (("interval", wire.SET_F_INTERVAL), ("timeout", wire.SET_F_TIMEOUT))
                           if flags & bit), timeout=timeout)


_LINE_MAX = 400


def _shorten(line: Optional[str]) -> Optional[str]:
    if line is None or len(line) <= _LINE_MAX:
        return line
    return f"{line[:_LINE_MAX]}... ({len(line)} characters)"
