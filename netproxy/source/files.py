"""The file source: Kubernetes manifests on disk (a file or a directory), loaded and watched.

Accepts what ``kubectl get svc,endpointslices -A -o yaml`` prints as is: ``kind: List`` (and typed
lists such as ``ServiceList``), multi-document YAML, JSON, ``v1 Service``, ``discovery.k8s.io/v1
EndpointSlice``, the legacy ``v1 Endpoints``, ``v1 Node`` (for this node's zone) and
``networking.k8s.io/v1 ServiceCIDR`` (the service CIDRs whose unowned addresses are dropped).
A file that fails to parse keeps the last good state; an invalid object is rejected on its own.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple, Union

import msgspec

from netproxy.core.model import EndpointSet, IPNetwork, NodeInfo, ServicePort, ValidationError, shown
from netproxy.source import jsonstream, plainservice, plainslice
from netproxy.source.convert import (
    is_mapping,
    loose_ref,
    not_for_this_proxy,
    object_ref,
    parse_endpoint_slice,
    parse_endpoints,
    parse_node,
    parse_service,
    parse_service_cidr,
)
from netproxy.source.itemmemo import ItemMemo, digest

log = logging.getLogger(__name__)

Key = Tuple[str, str]
MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")


class SourceError(Exception):
    """A file could not be read or parsed at all (as opposed to one bad object in it)."""


@dataclass
class Loaded:
    """Everything one load of the source produced, valid objects and rejections side by side."""

    services: Dict[Key, Tuple[ServicePort, ...]] = field(default_factory=dict)
    endpoints: Dict[Key, EndpointSet] = field(default_factory=dict)
    node: Optional[NodeInfo] = None
    errors: List[ValidationError] = field(default_factory=list)
    legacy: Dict[Key, EndpointSet] = field(default_factory=dict)
    """v1 Endpoints by service; :func:`merge` uses them only for services without slices."""
    service_cidrs: Dict[str, Tuple[IPNetwork, ...]] = field(default_factory=dict)
    """networking.k8s.io/v1 ServiceCIDR objects by name: their ``spec.cidrs``."""
    skipped: int = 0
    """Services, EndpointSlices and Endpoints left out as kube-proxy's informers leave them out
    (``service-proxy-name`` or ``headless`` labels: :func:`netproxy.source.convert.not_for_this_proxy`)."""


def manifest_files(path: str) -> List[str]:
    """The manifest files under ``path`` (itself, or a directory's files), sorted for stable loads."""
    if os.path.isdir(path):
        return sorted(os.path.join(path, n) for n in os.listdir(path)
                      if n.endswith(MANIFEST_SUFFIXES) and not n.startswith("."))
    if not os.path.exists(path):
        raise SourceError(f"{path}: no such file or directory")
    return [path]


def read_documents(path: str) -> List[Any]:
    """Parse one file into its documents; raises :class:`SourceError` naming the file and position."""
    # Imported here: a JSON source (what kubectl -o json and the bench write) never needs libyaml's
    # binding, whose import was 17 ms of every one-shot command's start.
    import yaml

    from netproxy.source import yamldocs

    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as err:
        raise SourceError(f"{path}: {err.strerror}") from None
    try:
        docs = [json.loads(text)] if path.endswith(".json") else yamldocs.read(text, path)
    except RecursionError:  # json's decoder recurses per nesting level; libyaml stops at 1,000 itself
        raise SourceError(f"{path}: not valid JSON: nested too deeply") from None
    except (ValueError, yaml.YAMLError) as err:
        raise SourceError(f"{path}: not valid {'JSON' if path.endswith('.json') else 'YAML'}: {err}") from None
    if docs and all(yamldocs.not_an_object(d) or not isinstance(d, (Mapping, ValidationError)) for d in docs):
        # Not a manifest at all (a stray file, a truncated write): reading it as "no services" would
        # delete every rule, so it is an unreadable source, as a syntax error is.
        raise SourceError(f"{path}: no document in it is a Kubernetes object (the first is {shown(docs[0])})"
                          if not isinstance(docs[0], ValidationError) else
                          f"{path}: no document in it is a Kubernetes object ({docs[0].message})")
    return docs


class Fresh(NamedTuple):
    """An object read for the first time (or changed), with the digest its conversion is kept under."""

    key: bytes
    obj: Mapping[str, Any]


class Converted(NamedTuple):
    """One object's conversion, as :func:`parse_part` places it: ``kind`` (``""`` for an object of
    another kind, ``"skipped"`` for one not for this proxy), its ``ref`` and ``value`` (the model
    objects), or the ``error`` that refused it.  Immutable: an :class:`~itemmemo.ItemMemo` reuses it."""

    kind: str
    ref: Any = None
    value: Any = None
    error: Optional[ValidationError] = None


Item = Union[Mapping[str, Any], ValidationError, Fresh, Converted]


def read_objects(path: str, memo: Optional[ItemMemo[Converted]] = None, plain_items: bool = False) -> Iterator[Item]:
    """The Kubernetes objects of one file, one at a time.  A JSON ``List`` is streamed
    (:mod:`jsonstream`): its items are converted as they are decoded, never all held as dicts.
    With ``memo`` (``run``'s reads of a file), an item whose bytes were in the previous read comes
    out as its :class:`Converted` without being decoded, and a new one as :class:`Fresh`.
    ``plain_items`` (the one-shot load, without the address cache): a plain IPv4 EndpointSlice or
    plain Service of a ``List`` comes out as its :class:`Converted`, decoded into typed structs
    (:func:`_plain_item`)."""
    if not path.endswith(".json"):
        yield from flatten(read_documents(path), path)
        return
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as err:
        raise SourceError(f"{path}: {err.strerror}") from None
    kindless: List[Any] = []  # items of a typed list (ServiceList...) name their kind only in the list
    try:
        for what, value in jsonstream.iter_document(text, raw=memo is not None or plain_items):
            if what == "raw":
                key = None
                if memo is not None:
                    key = digest(value)
                    hit = memo.get(key)
                    if hit is not None:
                        yield hit
                        continue
                elif plain_items:
                    plain = _plain_item(value)
                    if plain is not None:
                        yield plain
                        continue
                value = jsonstream.decode(value)
                kind = value.get("kind") if is_mapping(value) else None
                if isinstance(kind, str) and kind and not kind.endswith("List"):
                    yield value if key is None else Fresh(key, value)  # an object: as flatten hands it out
                    continue
                what = "item"  # kindless (a typed list's) or a list in the list: as the stream has it
            if what == "item":
                if is_mapping(value) and not value.get("kind"):
                    kindless.append(value)
                else:
                    yield from flatten([value], path)
                continue
            if kindless and is_mapping(value):
                yield from flatten([{**value, "items": kindless}], path)
            elif not is_mapping(value):
                raise SourceError(f"the document is {shown(value)}, not a Kubernetes object")
            elif not str(value.get("kind") or "").endswith("List"):
                yield from flatten([value], path)
    except ValueError as err:
        raise SourceError(f"{path}: not valid JSON: {err}") from None
    except RecursionError:
        raise SourceError(f"{path}: not valid JSON: nested too deeply") from None
    except SourceError as err:
        raise SourceError(f"{path}: {err}") from None


def _plain_item(raw: msgspec.Raw) -> Optional[Converted]:
    """A ``List`` item's conversion by the typed shortcuts (:mod:`plainslice`, :mod:`plainservice`),
    or None when it is not a plain EndpointSlice or Service.  An item is tried as a kind only when
    its bytes name it: a typed decode that fails (an exception) cost 2-4 us."""
    text = bytes(raw)
    if b'"EndpointSlice"' in text:
        endpoints = plainslice.converted(text)
        if endpoints is not None:
            return Converted("EndpointSlice", *endpoints)
    if b'"Service"' in text:
        ports = plainservice.converted(text)
        if ports is not None:
            return Converted("Service", *ports)
    return None


def flatten(docs: Sequence[Any], source: str = "") -> Iterator[Union[Mapping[str, Any], ValidationError]]:
    """Objects out of documents, unpacking ``List``/``ServiceList``/... as kubectl prints them.  A
    document refused by the YAML reader, or one that is no object at all, comes out as the
    :class:`ValidationError` that names it: the objects beside it are still used."""
    for doc in docs:
        if isinstance(doc, ValidationError):
            yield doc
            continue
        if not is_mapping(doc):
            yield ValidationError("object", f"? in {source}" if source else "?", "(root)",
                                  f"is {shown(doc)}, not a Kubernetes object")
            continue
        kind = doc.get("kind")
        kind = kind if isinstance(kind, str) else ""
        if kind.endswith("List") and isinstance(doc.get("items"), list):
            item_kind = kind[: -len("List")] or None
            for item in doc["items"]:
                if is_mapping(item) and not item.get("kind") and item_kind:
                    item = {**item, "kind": item_kind}  # typed lists omit the items' kind
                yield from flatten([item], source)
        else:
            yield doc


def parse_objects(objects: Iterator[Union[Mapping[str, Any], ValidationError]], node_name: str = "") -> Loaded:
    """Model objects from Kubernetes objects; each invalid one lands in ``errors``, the rest are used."""
    return merge([parse_part(objects, node_name)])


def parse_part(objects: Iterator[Item], node_name: str, remember_addresses: bool = True,
               memo: Optional[ItemMemo[Converted]] = None) -> Loaded:
    """One file's objects, converted; duplicates and legacy Endpoints are settled by :func:`merge`.
    ``remember_addresses=False``: endpoint addresses are parsed without the address cache (see
    :func:`load`).  ``memo``: where a :class:`Fresh` object's conversion is kept for the next read."""
    out = Loaded()
    seen: Set[Key] = set()
    for obj in objects:
        if type(obj) is Converted:  # the typed slices' and the memo's, first: 10k+ of them
            _place(out, seen, obj)
            continue
        if isinstance(obj, ValidationError):
            out.errors.append(obj)
            continue
        if isinstance(obj, Converted):
            _place(out, seen, obj)
            continue
        key = None
        if isinstance(obj, Fresh):
            key, obj = obj
        converted = convert_object(obj, node_name, remember_addresses)
        if key is not None and memo is not None:
            memo.put(key, converted)
        _place(out, seen, converted)
    return out


def convert_object(obj: Mapping[str, Any], node_name: str, remember_addresses: bool = True) -> Converted:
    """One object's conversion, alone: nothing here depends on the other objects of the load."""
    kind = obj.get("kind")
    try:
        if kind is not None and not isinstance(kind, str):
            raise ValidationError("object", loose_ref(obj), "kind", f"{shown(kind)} is not a string")
        label = not_for_this_proxy(obj) if kind in ("Service", "EndpointSlice", "Endpoints") else None
        if label is not None:
            log.debug("skipping %s %s: labelled %s (not for this proxy, as kube-proxy's informers)",
                      kind, loose_ref(obj), label)
            return Converted("skipped")
        if kind == "Service":
            ref = object_ref(obj)
            try:
                return Converted(kind, ref[1:], parse_service(obj, checked_ref=ref))
            except ValidationError as err:  # named still: a second Service of that name is "defined twice"
                return Converted(kind, ref[1:], error=err)
        if kind == "EndpointSlice":
            ref = object_ref(obj)
            return Converted(kind, ref[1:], parse_endpoint_slice(obj, cache=remember_addresses, checked_ref=ref))
        if kind == "Endpoints":
            return Converted(kind, None, parse_endpoints(obj))
        if kind == "ServiceCIDR":
            cidr_name, cidrs = parse_service_cidr(obj)
            return Converted(kind, cidr_name, cidrs)
        if kind == "Node":
            return Converted(kind, None, _parse_node(obj, node_name))
        log.debug("ignoring object of kind %s", shown(kind))
        return Converted("")
    except ValidationError as err:
        return Converted("error", error=err)


def _place(out: Loaded, seen: Set[Key], c: Converted) -> None:
    """One converted object into the load, judged against the objects before it (names defined twice)."""
    if c.kind == "Service":
        if c.ref in seen:
            out.errors.append(ValidationError(c.kind, f"{c.ref[0]}/{c.ref[1]}", "metadata.name", "is defined twice"))
            return
        seen.add(c.ref)
        if c.error is not None:
            out.errors.append(c.error)
        else:
            out.services[c.ref] = c.value
    elif c.error is not None:
        out.errors.append(c.error)
    elif c.kind == "skipped":
        out.skipped += 1
    elif c.kind == "EndpointSlice":
        if c.value is not None:
            out.endpoints[c.ref] = c.value
    elif c.kind == "Endpoints":
        out.legacy[(c.value.namespace, c.value.service)] = c.value
    elif c.kind == "ServiceCIDR":
        if c.ref in out.service_cidrs:
            out.errors.append(ValidationError(c.kind, c.ref, "metadata.name", "is defined twice"))
            return
        out.service_cidrs[c.ref] = c.value
    elif c.kind == "Node" and c.value is not None:
        out.node = c.value


def merge(parts: Sequence[Loaded]) -> Loaded:
    """The parts of several files as one load: a service defined in two files is rejected in the
    later one; legacy Endpoints stand in only for services without slices (kube-proxy reads one
    or the other)."""
    if len(parts) == 1 and not parts[0].legacy:
        return parts[0]
    out = Loaded()
    for part in parts:
        for key, ports in part.services.items():
            if key in out.services:
                out.errors.append(ValidationError("Service", f"{key[0]}/{key[1]}", "metadata.name",
                                                  "is defined twice"))
                continue
            out.services[key] = ports
        out.endpoints.update(part.endpoints)
        out.legacy.update(part.legacy)
        out.service_cidrs.update(part.service_cidrs)
        out.skipped += part.skipped
        out.node = part.node or out.node
        out.errors.extend(part.errors)
    sliced = {(e.namespace, e.service) for e in out.endpoints.values()}
    for (ns, svc), eps in out.legacy.items():
        if (ns, svc) not in sliced:
            out.endpoints[(ns, f"Endpoints/{svc}")] = eps
    return out


def _parse_node(obj: Mapping[str, Any], node_name: str) -> Optional[NodeInfo]:
    meta = obj.get("metadata") or {}
    name = meta.get("name") if isinstance(meta, Mapping) else None
    if not node_name or name != node_name:
        return None  # another node's object: only this node's zone matters
    return parse_node(obj, node_name)


FileSig = Tuple[int, int, int]  # (mtime_ns, size, inode)


def _signature(path: str) -> Optional[FileSig]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


Memos = Dict[str, ItemMemo[Converted]]
"""Per file: its items' conversions by digest (:mod:`itemmemo`)."""


def load(path: str, node_name: str = "", cache: Optional[Dict[str, Tuple[FileSig, Loaded]]] = None,
         remember_addresses: bool = True, memos: Optional[Memos] = None) -> Loaded:
    """Load every manifest under ``path``; raises :class:`SourceError` if any file cannot be parsed.

    With ``cache`` (path → (signature, part)), files whose (mtime, size, inode) did not change are
    not read again: a directory with a 10k-service file and a small file that changes costs the
    small file's parse, not the big one's.

    ``remember_addresses``: parse endpoint addresses through the address cache, which pays when the
    same file is read again (``run``).  A command that loads once passes False: at 10k x 10 the
    cache held 100k entries (18 MB, the load's peak) and cost its lookups for nothing.

    ``memos``: a changed JSON file's items whose bytes were in its previous read are not decoded or
    converted again (:mod:`itemmemo`; ``run``).
    """
    with gc_paused():
        return _load(path, node_name, cache, remember_addresses, memos)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while a source's objects are built: a 10k-service load allocates
    ~1M dicts, strings and model objects, none in cycles, and the collector's passes over them cost
    1.2 s of a 4 s ``netproxy sync`` (measured at 10k x 10)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _load(path: str, node_name: str, cache: Optional[Dict[str, Tuple[FileSig, Loaded]]],
          remember_addresses: bool, memos: Optional[Memos] = None) -> Loaded:
    parts: List[Loaded] = []
    fresh: Dict[str, Tuple[FileSig, Loaded]] = {}
    files = manifest_files(path)
    if memos is not None:
        for gone in set(memos) - set(files):
            del memos[gone]
    for f in files:
        sig = _signature(f)
        hit = cache.get(f) if cache is not None else None
        if hit is not None and sig is not None and hit[0] == sig:
            part = hit[1]
        elif memos is None:
            # Without the address cache (a one-shot load), plain items take the typed shortcuts,
            # which parse their addresses uncached as _plain_v4_endpoints does.
            part = parse_part(read_objects(f, plain_items=not remember_addresses), node_name, remember_addresses)
        else:
            memo = memos.setdefault(f, ItemMemo())
            try:
                part = parse_part(read_objects(f, memo), node_name, remember_addresses, memo)
            except BaseException:
                memo.discard()  # a file that does not parse keeps its last good reference
                raise
            memo.rotate()
        if sig is not None:
            fresh[f] = (sig, part)
        parts.append(part)
    if cache is not None:
        cache.clear()
        cache.update(fresh)
    return merge(parts) if parts else Loaded()


class FileSource:
    """Loads ``path`` into a tracker, then polls it and reloads on change (``netproxy run``).

    Polling the files' (mtime, size, inode) every ``poll_interval`` is cheap for a handful of files
    and needs no inotify binding; it catches editors that replace the file as well as in-place writes.
    """

    def __init__(self, path: str, node_name: str = "", poll_interval: float = 0.02, max_settle: float = 1.0) -> None:
        self.path = path
        self.node_name = node_name
        self.poll_interval = poll_interval
        self.max_settle = max_settle
        """Longest a change waits for the file to hold still before it is loaded anyway."""
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._signature: Optional[Tuple[Tuple[str, FileSig], ...]] = None
        self._cache: Dict[str, Tuple[FileSig, Loaded]] = {}
        self._memos: Memos = {}
        self._loads = 0
        self.last_error: Optional[str] = None

    def _current_signature(self) -> Tuple[Tuple[str, FileSig], ...]:
        try:
            files = manifest_files(self.path)
        except SourceError:
            return ()
        sigs = ((f, _signature(f)) for f in files)
        return tuple((f, sig) for f, sig in sigs if sig is not None)

    def node(self) -> Optional[NodeInfo]:
        """This node's Node in the files now (for what is configured from it at start); the files
        parsed here stay in the cache, so the first :meth:`load_into` does not parse them again."""
        return self._read().node

    def _read(self) -> Loaded:
        # The address cache pays when a changed file is read again; filling it on the first read
        # cost start-up 0.4 s and 18 MB at 10k x 10 for nothing yet: it is used from the second.
        loaded = load(self.path, self.node_name, self._cache, remember_addresses=self._loads > 0, memos=self._memos)
        self._loads += 1
        return loaded

    def load_into(self, tracker: Any) -> Optional[Loaded]:
        """One load; on a parse error keep the tracker's last good state and remember the error."""
        self._signature = self._current_signature()
        try:
            loaded = self._read()
        except SourceError as err:
            self.last_error = str(err)
            log.error("source not reloaded, keeping the last good state: %s", err)
            return None
        self.last_error = None
        for rejected in loaded.errors:
            tracker.reject(rejected)
        if loaded.node is not None:
            tracker.set_node(loaded.node)
        tracker.replace_service_cidrs(loaded.service_cidrs)
        tracker.replace_services(loaded.services)
        tracker.replace_endpoints(loaded.endpoints)
        tracker.services_synced()
        tracker.endpoints_synced()
        return loaded

    def start(self, tracker: Any) -> None:
        self.load_into(tracker)
        self._thread = threading.Thread(target=self._watch, args=(tracker,), name="file-source", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _watch(self, tracker: Any) -> None:
        changing_since: Optional[float] = None
        while not self._stop.wait(self.poll_interval):
            seen = self._current_signature()
            if seen == self._signature:
                changing_since = None
                continue
            now = time.monotonic()
            changing_since = now if changing_since is None else changing_since
            # Debounce: a writer that truncates and rewrites in place (`kubectl ... > file`) shows an
            # empty or half-written file first; load only once the file held still for one interval.
            # But not forever: a file rewritten more often than that (an update storm) would never be
            # loaded, so after max_settle it is loaded as it is (a half-written file that does not
            # parse keeps the last good state).
            if self._stop.wait(self.poll_interval):
                return
            if self._current_signature() != seen and now - changing_since < self.max_settle:
                continue
            changing_since = None
            log.info("source %s changed, reloading", self.path)
            self.load_into(tracker)
