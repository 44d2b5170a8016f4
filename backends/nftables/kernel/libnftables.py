"""The libnftables writer: the transaction as nft text through the ``nftables`` binding.

It hands one text buffer to ``nftables.Nftables().cmd()``, which libnftables sends as one netlink
batch: all of it applies or none does.  It binds to the network namespace of the calling process.
The fallback writer (``--nftables-writer libnftables``) and the oracle the netlink writer is
tested against: the same rendered sync through both must give the same ``nft -j list ruleset``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
from typing import AbstractSet, Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

from netproxy.backends.base import BackendUnavailable, SyncError
from netproxy.backends.nftables import names, serialise
from netproxy.backends.nftables.monitor import Watched
from netproxy.backends.nftables.objects import Element, Set
from netproxy.backends.nftables.serialise import Op

log = logging.getLogger(__name__)


_LOCATE_MAX_BYTES = 1 << 20
_TRIM_AFTER_BYTES = 1 << 20


def _release_heap() -> None:
    """Give the heap libnftables just freed back to the kernel.

    Parsing a 100k-element transaction takes libnftables ~230 MB, freed when the command ends,
    but glibc keeps it mapped: a long-running proxy would sit at its peak forever.
    """
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to do
        ctypes.CDLL("libc.so.6").malloc_trim(0)


_LINE_MAX = 400


def _shorten(line: Optional[str]) -> Optional[str]:
    """A failing line fit for a log: a full sync's element command can hold 100k elements."""
    if line is None or len(line) <= _LINE_MAX:
        return line
    return f"{line[:_LINE_MAX]}... ({len(line)} characters)"


def failing_command(error: str) -> Optional[str]:
    """The command libnftables echoes after its first ``Error:`` line."""
    lines = error.splitlines()
    for i, line in enumerate(lines):
        if "Error:" in line and i + 1 < len(lines):
            return lines[i + 1].strip()
    return None


class LibNftRunner:
    def __init__(self) -> None:
        try:
            import nftables  # the binding shipped with libnftables (pip-nftables)
        except ImportError as exc:
            raise BackendUnavailable("the nftables Python binding is not installed", detail=str(exc)) from exc
        try:
            self._nft = nftables.Nftables()
        except OSError as exc:
            raise BackendUnavailable("libnftables cannot be loaded", detail=str(exc)) from exc
        self._nft.set_handle_output(False)
        self._check: Optional[Any] = None
        self._gen_socket: Optional[Tuple[Any, int, Any]] = None
        self._reader: Optional[Any] = None
        """A netlink socket for the stamps of restart by adoption (made when first needed)."""
        self.notifications = Watched()

    def watch(self, on: bool) -> None:
        self.notifications.watch(on)

    def others_touched(self, own: AbstractSet[int]) -> Optional[bool]:
        touched: Optional[bool] = self.notifications.others_touched(own)
        return touched

    def _cmd(self, text: str, json_output: bool = False) -> Tuple[int, str, str]:
        self._nft.set_json_output(json_output)
        rc, out, err = self._nft.cmd(text)
        return int(rc), str(out or ""), str(err or "")

    def apply(self, ops: Sequence[Op]) -> int:
        text = serialise.ops_text(ops)
        rc, _, err = self._cmd(text)
        if len(text) > _TRIM_AFTER_BYTES:
            _release_heap()
        if rc != 0:
            line = self.locate_failure(text) or failing_command(err)
            raise SyncError("libnftables refused the transaction", line=_shorten(line), detail=err.strip(),
                            payload=text)
        return len(text)

    def locate_failure(self, text: str) -> Optional[str]:
        """The first command of ``text`` that the kernel refuses, found by dry runs of its prefixes.

        libnftables names the wrong command when the kernel refuses an element in a batch (it
        blamed an earlier ``add map`` for an element's EEXIST), and the failing line is what an
        operator needs.  A prefix of a batch fails iff it contains the first refused command, so a
        binary search over prefixes finds it.  Only for small payloads (incremental syncs): a
        dry run costs what the real transaction costs.
        """
        lines = text.splitlines()
        if len(text) > _LOCATE_MAX_BYTES or not lines:
            return None
        check = self._dry_run_context()
        if check is None:
            return None

        def ok(n: int) -> bool:
            return int(check.cmd("\n".join(lines[:n]) + "\n")[0]) == 0

        lo, hi = 0, len(lines)
        if ok(hi):
            return None  # the refusal did not reproduce (someone else changed the table meanwhile)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
        return lines[hi - 1]

    def _dry_run_context(self) -> Optional[Any]:
        """A second libnftables context in dry-run mode (the kernel checks the batch, then aborts it).

        The Python binding does not wrap ``nft_ctx_set_dry_run``; it is called on the binding's
        context through ctypes, here only.
        """
        if self._check is not None:
            return self._check
        try:
            import nftables

            check = nftables.Nftables()
            ctx = check._Nftables__ctx  # name-mangled private attribute of the binding
            set_dry_run = ctypes.CDLL("libnftables.so.1").nft_ctx_set_dry_run
            set_dry_run.argtypes = [ctypes.c_void_p, ctypes.c_bool]
            set_dry_run(ctx, True)
        except (ImportError, OSError, AttributeError) as exc:
            log.debug("no dry-run context to locate a refused command: %s", exc)
            return None
        self._check = check
        return check

    def _list(self, what: str) -> Optional[List[Dict[str, Any]]]:
        rc, out, err = self._cmd(what, json_output=True)
        if rc != 0:
            if "No such file or directory" in err:
                return None
            raise SyncError("cannot read the nftables ruleset", line=what, detail=err.strip())
        try:
            doc = json.loads(out)
        except ValueError:
            # Seen with a table another process owns (NFT_TABLE_F_OWNER): the listing is not one JSON
            # document.  A read that fails is a failed sync (retried), never a crash of `run`.
            raise SyncError("cannot read the nftables ruleset: the listing is not JSON", line=what,
                            detail=out.strip()[:300]) from None
        items: List[Dict[str, Any]] = doc.get("nftables", []) if isinstance(doc, dict) else []
        return items

    def existing_tables(self) -> FrozenSet[str]:
        items = self._list("list tables") or []
        return frozenset(str(t["table"]["family"]) for t in items
                         if "table" in t and t["table"].get("name") == names.TABLE
                         and t["table"].get("family") in ("ip", "ip6"))

    def read_sets(self, family: str) -> List[Tuple[Set, List[Element]]]:
        # "list sets" leaves the maps out: the 100k-element endpoint maps are not read back.
        items = self._list(f"list sets table {family} {names.TABLE}")
        return sets_from_json(items or [])

    def read_elements(self, family: str, set_name: str) -> List[Element]:
        ident = names.identifier(set_name)
        for kind in ("map", "set"):
            rc, out, err = self._cmd(f"list {kind} {family} {names.TABLE} {ident}", json_output=True)
            if rc == 0:
                return elements_from_json(json.loads(out).get("nftables", []), set_name)
        if "No such file or directory" in err:
            return []
        raise SyncError(f"cannot read {family} {names.TABLE} {ident}", detail=err.strip())

    def generation(self) -> Optional[int]:
        # libnftables does not expose NFT_MSG_GETGEN; pyroute2 (already a dependency) does.
        try:
            if self._gen_socket is None:
                # The package first: importing the submodule directly takes its import lock before
                # pyroute2's, the reverse of `import pyroute2` in another thread (the core's node
                # address watcher), and Python aborted that thread with a _DeadlockError.
                import pyroute2  # noqa: F401
                from pyroute2.netlink.nfnetlink.nftsocket import NFT_MSG_GETGEN, NFTSocket, nft_gen_msg

                self._gen_socket = (NFTSocket(), NFT_MSG_GETGEN, nft_gen_msg)
            sock, msg_type, msg_class = self._gen_socket
            for msg in sock.request_get(msg_class(), msg_type):
                gen = msg.get_attr("NFTA_GEN_ID")
                if gen is not None:
                    return int(gen)
        except Exception as exc:  # noqa: BLE001 - any failure only costs a full rewrite
            log.debug("cannot read the nftables generation: %s", exc)
        return None


    def _netlink(self) -> Any:
        from netproxy.backends.nftables.kernel.nlsocket import NlSocket

        if self._reader is None:
            try:
                self._reader = NlSocket()
            except OSError as exc:
                raise SyncError("no nf_tables netlink socket to read the stamps", detail=str(exc)) from exc
        return self._reader

    def read_stamped(self, family: str, set_names: Sequence[str]) -> Dict[str, List[Element]]:
        # Over netlink, as the netlink writer reads them: nft's JSON of 10k-100k commented elements
        # would be printed and parsed again, for nothing.
        from netproxy.backends.nftables.kernel import readback

        found: Dict[str, List[Element]] = readback.read_named(self._netlink(), family, set_names)
        return found

    def get_elements(self, family: str, set_name: str, keys: Sequence[str]) -> List[Element]:
        from netproxy.backends.nftables.kernel import readback

        found: List[Element] = readback.get_elements(self._netlink(), family, set_name, keys)
        return found

    def chain_names(self, family: str) -> FrozenSet[str]:
        from netproxy.backends.nftables.kernel import readback

        chains: FrozenSet[str] = readback.chain_names(self._netlink(), family)
        return chains

    def chain_uses(self, family: str) -> Dict[str, int]:
        from netproxy.backends.nftables.kernel import readback

        uses: Dict[str, int] = readback.chain_uses(self._netlink(), family)
        return uses

    def probe(self) -> None:
        if self._list("list tables") is None:
            raise BackendUnavailable("libnftables cannot list tables")

    def delete_tables(self) -> List[str]:
        ours = sorted(self.existing_tables())
        if ours:
            text = "".join(f"delete table {fam} {names.TABLE}\n" for fam in ours)
            rc, _, err = self._cmd(text)
            if rc != 0:
                raise SyncError("cannot delete netproxy's tables", line=failing_command(err), detail=err.strip())
        return [f"{fam} {names.TABLE}" for fam in ours]


def sets_from_json(items: Sequence[Dict[str, Any]]) -> List[Tuple[Set, List[Element]]]:
    """Sets and their elements (with the seconds they have left) from ``nft -j list sets``."""
    out = []
    for item in items:
        s = item.get("set")
        if s is None:
            continue
        timeout = s.get("timeout")
        key_type = s.get("type")
        spec = Set(str(s["name"]), key_type if isinstance(key_type, str) else " . ".join(key_type),
                   flags=tuple(s.get("flags", ())), timeout=int(timeout) if timeout is not None else None)
        elements = []
        for raw in s.get("elem", ()):
            if isinstance(raw, dict) and "elem" in raw:
                val, expires = raw["elem"].get("val"), raw["elem"].get("expires")
            else:
                val, expires = raw, None
            key = _value_text(val)
            if key is not None:
                elements.append(Element(spec.name, key, expires=int(expires) if expires is not None else None))
        out.append((spec, elements))
    return out


def elements_from_json(items: Sequence[Dict[str, Any]], set_name: str) -> List[Element]:
    """A set's or map's elements (key, value, seconds left) from ``nft -j list set|map``."""
    out = []
    for item in items:
        spec = item.get("map") or item.get("set")
        if not isinstance(spec, dict):
            continue
        for raw in spec.get("elem", ()):
            value = None
            if isinstance(raw, list) and len(raw) == 2:  # a map: [key, value]
                raw, value = raw[0], _value_text(raw[1])
            timeout = None
            if isinstance(raw, dict) and "elem" in raw:
                key, expires = _value_text(raw["elem"].get("val")), raw["elem"].get("expires")
                timeout = raw["elem"].get("timeout")
            else:
                key, expires = _value_text(raw), None
            if key is not None:
                out.append(Element(set_name, key, value, expires=int(expires) if expires is not None else None,
                                   timeout=int(timeout) if timeout is not None else None))
    return out


def _value_text(val: Any) -> Optional[str]:
    """nft text for a set key from libnftables JSON: an address, a number, or a concatenation."""
    if isinstance(val, (str, int)) and not isinstance(val, bool):
        return str(val)
    if isinstance(val, dict) and isinstance(val.get("concat"), list):
        parts = [_value_text(v) for v in val["concat"]]
        if all(p is not None for p in parts):
            return " . ".join(str(p) for p in parts)
    return None  # a range, a prefix...: not something netproxy writes
