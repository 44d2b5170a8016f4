"""A small stand-in for the Kubernetes API server, speaking its wire protocol over plain HTTP.

No real API server can be installed here, so the source's tests run the official client against this.
It does what the source relies on, the way the real server does it:

- one cluster-wide, monotonically increasing ``resourceVersion`` (etcd's revision) shared by every
  collection; every write bumps it and is recorded in an event log;
- lists (cluster-wide and namespaced paths) with ``limit`` / ``continue`` pagination over a consistent
  snapshot taken at the first page, ``metadata.resourceVersion`` of that snapshot, items without
  ``kind`` (the list carries it), ``fieldSelector`` / ``labelSelector`` equality terms;
- watches as chunked ``application/json`` streams of ``{"type", "object"}`` lines: ``ADDED``,
  ``MODIFIED``, ``DELETED`` replayed from the event log after the requested version, ``BOOKMARK``
  when ``allowWatchBookmarks=true``, ``timeoutSeconds``, and an ``ERROR`` event carrying a 410
  ``Status`` when the version was compacted away (as the server does: HTTP 200, then the error);
- create (POST), replace (PUT), delete (DELETE) and get, so a test can change state through the API;
- faults on demand: :meth:`ApiServer.fail_next` (any status, e.g. 500), :meth:`ApiServer.drop_watches`
  (connections cut mid-stream, no terminating chunk), :meth:`ApiServer.expire_watches` (410 in the
  stream), :meth:`ApiServer.compact` (old versions and continue tokens become 410).

Run it alone (e.g. inside a network namespace for the kernel tests)::

    python -m netproxy_lab.apiserver --listen 127.0.0.1:0 --port-file /tmp/port [--load objs.json]
"""

from __future__ import annotations

import argparse
import base64
import bisect
import contextlib
import copy
import json
import os
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import parse_qs, urlsplit

Obj = Dict[str, Any]
Key = Tuple[str, str]


class Resource:
    def __init__(self, plural: str, prefix: str, kind: str, namespaced: bool) -> None:
        self.plural = plural
        self.prefix = prefix  # "/api/v1" or "/apis/<group>/<version>"
        self.kind = kind
        self.namespaced = namespaced
        self.api_version = prefix[len("/api/"):] if prefix.startswith("/api/") else prefix[len("/apis/"):]


RESOURCES = {r.plural: r for r in (
    Resource("services", "/api/v1", "Service", True),
    Resource("endpoints", "/api/v1", "Endpoints", True),
    Resource("nodes", "/api/v1", "Node", False),
    Resource("endpointslices", "/apis/discovery.k8s.io/v1", "EndpointSlice", True),
    Resource("servicecidrs", "/apis/networking.k8s.io/v1", "ServiceCIDR", False),
)}


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message

    def status(self) -> Obj:
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self.message, "reason": self.reason, "code": self.code}


Term = Tuple[str, Optional[str], bool]
"""(key, value, wanted): ``a=b`` → (a, b, True), ``c!=d`` → (c, d, False); label existence terms
``k`` → (k, None, True), ``!k`` → (k, None, False) (kube-proxy's informers send ``!k,!l``)."""


def _selector_terms(text: Optional[str]) -> List[Term]:
    """The equality and existence subset of Kubernetes' selectors, as both kinds use it."""
    terms: List[Term] = []
    for part in (p.strip() for p in (text or "").split(",")):
        if not part:
            continue
        if "!=" in part:
            k, v = part.split("!=", 1)
            terms.append((k.strip(), v.strip(), False))
        elif "=" in part:
            k, v = part.split("==", 1) if "==" in part else part.split("=", 1)
            terms.append((k.strip(), v.strip(), True))
        elif part.startswith("!"):
            terms.append((part[1:].strip(), None, False))
        else:
            terms.append((part, None, True))
    return terms


def _matches(obj: Obj, fields: List[Term], labels: List[Term]) -> bool:
    meta = obj.get("metadata") or {}
    for path, want, eq in fields:
        value: Any = obj
        for step in path.split("."):
            value = value.get(step) if isinstance(value, dict) else None
        if (str(value or "") == want) != eq:
            return False
    obj_labels = meta.get("labels") or {}
    return all(((k in obj_labels) if v is None else (obj_labels.get(k) == v)) == eq for k, v, eq in labels)


class Watcher:
    def __init__(self, resource: Resource, position: int, fields: List[Term],
                 labels: List[Term], bookmarks: bool, namespace: Optional[str]) -> None:
        self.resource = resource
        self.position = position
        self.fields = fields
        self.labels = labels
        self.bookmarks = bookmarks
        self.namespace = namespace
        self.dropped = False
        self.expired = False
        self.bookmark_due = False
        self.sock: Optional[socket.socket] = None


class Store:
    """Objects, the event log and the faults; every method is thread-safe."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.rv = 1
        self.objects: Dict[str, Dict[Key, Obj]] = {p: {} for p in RESOURCES}
        # (rv, plural, type, object, the object before a MODIFIED): a watch with a selector turns a
        # change across its selector into ADDED or DELETED, as the real server's watch cache does.
        self.log: List[Tuple[int, str, str, Obj, Optional[Obj]]] = []
        self.log_rvs: List[int] = []  # the log's versions, for bisection
        self.compacted = 0  # events at or below this version are gone
        self.snapshots: Dict[str, Tuple[int, List[Obj]]] = {}
        self.watchers: List[Watcher] = []
        self.faults: List[Tuple[int, Optional[str], bool, int]] = []  # (status, path part, watch only, count)
        self.requests: List[Tuple[str, str, Dict[str, str]]] = []
        self.closed = False
        self.down_until = 0.0  # monotonic: until then every request is cut without an answer
        self.slow_until = 0.0
        self.slow_delay = 0.0  # seconds added before each answer until slow_until
        self.refused = 0  # requests cut while down (the client's reconnect attempts)
        self.unserved: Dict[str, int] = {}
        """plural → 404 (an older server without the resource) or 403 (RBAC denies it), for every
        request to it until the entry is removed."""
        self.authorizations: List[str] = []  # distinct Authorization headers seen (a test checks tokens are sent)

    def go_down(self, seconds: float) -> None:
        """An outage: every open watch is cut, and every request for ``seconds`` is closed unanswered."""
        with self.cond:
            self.down_until = time.monotonic() + seconds
        self.drop_watches()

    def go_slow(self, seconds: float, delay: float) -> None:
        with self.cond:
            self.slow_until = time.monotonic() + seconds
            self.slow_delay = delay

    # -- writes ---------------------------------------------------------------------------------

    def _record(self, plural: str, event_type: str, obj: Obj, old: Optional[Obj] = None) -> Obj:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.log.append((self.rv, plural, event_type, obj, old))
        self.log_rvs.append(self.rv)
        self.cond.notify_all()
        return obj

    def _key(self, res: Resource, obj: Obj) -> Key:
        meta = obj.setdefault("metadata", {})
        if res.namespaced:
            meta.setdefault("namespace", "default")
        return (meta.get("namespace", ""), meta["name"])

    def _stamp(self, res: Resource, obj: Obj) -> Obj:
        obj = copy.deepcopy(obj)
        obj["kind"] = res.kind
        obj["apiVersion"] = res.api_version
        self._key(res, obj)
        return obj

    def create(self, plural: str, obj: Obj) -> Obj:
        res = RESOURCES[plural]
        obj = self._stamp(res, obj)
        with self.cond:
            key = self._key(res, obj)
            if key in self.objects[plural]:
                raise ApiError(409, "AlreadyExists", f'{plural} "{key[1]}" already exists')
            obj["metadata"].setdefault("uid", str(uuid.uuid4()))
            obj["metadata"].setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            self.objects[plural][key] = obj
            return self._record(plural, "ADDED", obj)

    def replace(self, plural: str, obj: Obj) -> Obj:
        res = RESOURCES[plural]
        obj = self._stamp(res, obj)
        with self.cond:
            key = self._key(res, obj)
            old = self.objects[plural].get(key)
            if old is None:
                raise ApiError(404, "NotFound", f'{plural} "{key[1]}" not found')
            obj["metadata"]["uid"] = old["metadata"].get("uid")
            obj["metadata"]["creationTimestamp"] = old["metadata"].get("creationTimestamp")
            self.objects[plural][key] = obj
            return self._record(plural, "MODIFIED", obj, old)

    def apply(self, plural: str, obj: Obj) -> Obj:
        """Create or replace (a test convenience, like ``kubectl apply``)."""
        res = RESOURCES[plural]
        with self.cond:
            exists = self._key(res, self._stamp(res, obj)) in self.objects[plural]
            return self.replace(plural, obj) if exists else self.create(plural, obj)

    def delete(self, plural: str, namespace: str, name: str) -> Obj:
        with self.cond:
            key = (namespace if RESOURCES[plural].namespaced else "", name)
            old = self.objects[plural].pop(key, None)
            if old is None:
                raise ApiError(404, "NotFound", f'{plural} "{name}" not found')
            gone = copy.deepcopy(old)
            return self._record(plural, "DELETED", gone)

    def bulk_load(self, plural: str, objs: List[Obj]) -> None:
        """Many creates in one go (for scale tests): the same versions and log as one create each."""
        res = RESOURCES[plural]
        with self.cond:
            for obj in objs:  # taken over as they are: the caller hands fresh dicts
                obj["kind"] = res.kind
                obj["apiVersion"] = res.api_version
                self._key(res, obj)
                obj["metadata"].setdefault("uid", str(uuid.uuid4()))
                self.objects[plural][self._key(res, obj)] = obj
                self.rv += 1
                obj["metadata"]["resourceVersion"] = str(self.rv)
                self.log.append((self.rv, plural, "ADDED", obj, None))
                self.log_rvs.append(self.rv)
            self.cond.notify_all()

    # -- faults ---------------------------------------------------------------------------------

    def compact(self) -> int:
        """Forget every event so far (etcd compaction): older versions and continue tokens give 410."""
        with self.cond:
            self.compacted = self.rv
            self.log = []
            self.log_rvs = []
            self.snapshots.clear()
            return self.rv

    def fail_next(self, status: int = 500, count: int = 1, path: Optional[str] = None,
                  watch_only: bool = False) -> None:
        with self.cond:
            self.faults.append((status, path, watch_only, count))

    def take_fault(self, path: str, is_watch: bool) -> Optional[int]:
        with self.cond:
            for i, (status, part, watch_only, count) in enumerate(self.faults):
                if (part is None or part in path) and (is_watch or not watch_only):
                    if count <= 1:
                        del self.faults[i]
                    else:
                        self.faults[i] = (status, part, watch_only, count - 1)
                    return status
        return None

    def drop_watches(self) -> int:
        """Cut every open watch connection mid-stream, as a load balancer or a crash would."""
        with self.cond:
            for w in self.watchers:
                w.dropped = True
                if w.sock is not None:
                    with contextlib.suppress(OSError):
                        w.sock.shutdown(socket.SHUT_RDWR)
            self.cond.notify_all()
            return len(self.watchers)

    def expire_watches(self) -> int:
        """Send a 410 ERROR event on every open watch (the watch cache fell behind)."""
        with self.cond:
            for w in self.watchers:
                w.expired = True
            self.cond.notify_all()
            return len(self.watchers)

    def bookmark(self) -> None:
        with self.cond:
            for w in self.watchers:
                w.bookmark_due = True
            self.cond.notify_all()

    def wait_watchers(self, plural: str, count: int = 1, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            while sum(w.resource.plural == plural for w in self.watchers) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
            return True


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as separate writes: no 40 ms delayed-ACK stall
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    # -- plumbing -------------------------------------------------------------------------------

    def _send_json(self, code: int, body: Obj) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _route(self) -> Tuple[Resource, Optional[str], Optional[str], Dict[str, str]]:
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        parts = [p for p in url.path.split("/") if p]
        prefix_len = 2 if parts[:1] == ["api"] else 3
        prefix = "/" + "/".join(parts[:prefix_len])
        rest = parts[prefix_len:]
        namespace = None
        if len(rest) >= 2 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        if not rest or rest[0] not in RESOURCES or RESOURCES[rest[0]].prefix != prefix or len(rest) > 2:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({url.path})")
        return RESOURCES[rest[0]], namespace, (rest[1] if len(rest) == 2 else None), query

    def _outage(self, method: str) -> bool:
        """Test control (``POST /_fault/down?seconds=S``, ``/_fault/slow?seconds=S&delay=D``,
        ``/_fault/drop``, ``/_fault/expire``) and the outage itself; True when the request is done."""
        store = self.server.store
        url = urlsplit(self.path)
        if url.path.startswith("/_fault/") and method == "POST":
            query = {k: float(v[-1]) for k, v in parse_qs(url.query).items()}
            verb = url.path[len("/_fault/"):]
            if verb == "down":
                store.go_down(query["seconds"])
            elif verb == "slow":
                store.go_slow(query["seconds"], query["delay"])
            elif verb == "drop":
                store.drop_watches()
            elif verb == "expire":
                store.expire_watches()
            else:
                raise ApiError(404, "NotFound", f"no fault {verb!r}")
            self._send_json(200, {"fault": verb, "refused": store.refused})
            return True
        now = time.monotonic()
        if now < store.down_until:
            with store.cond:
                store.refused += 1
            self.close_connection = True  # no status line at all: the client sees the connection drop
            return True
        if now < store.slow_until:
            time.sleep(store.slow_delay)
        return False

    def _handle(self, method: str) -> None:
        store = self.server.store
        try:
            if self._outage(method):
                return
            res, namespace, name, query = self._route()
            is_watch = query.get("watch") in ("true", "1")
            with store.cond:
                store.requests.append((method, urlsplit(self.path).path, query))
                auth = self.headers.get("Authorization")
                if auth and auth not in store.authorizations:
                    store.authorizations.append(auth)
            unserved = store.unserved.get(res.plural)
            if unserved == 404:
                raise ApiError(404, "NotFound", f"the server could not find the requested resource ({res.plural})")
            if unserved is not None:
                raise ApiError(unserved, "Forbidden", f'{res.plural} is forbidden: User "system:serviceaccount:'
                               f'kube-system:netproxy" cannot list resource "{res.plural}"')
            status = store.take_fault(self.path, is_watch)
            if status is not None:
                raise ApiError(status, "InternalError" if status >= 500 else "Injected", f"injected {status}")
            if method == "GET" and name is None:
                if is_watch:
                    self._watch(res, namespace, query)
                else:
                    self._send_json(200, self._list(res, namespace, query))
                return
            self._send_json(*self._write(method, res, namespace, name))
        except ApiError as err:
            self._send_json(err.code, err.status())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._handle("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._handle("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._handle("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._handle("DELETE")

    # -- reads ----------------------------------------------------------------------------------

    def _list(self, res: Resource, namespace: Optional[str], query: Dict[str, str]) -> Obj:
        store = self.server.store
        limit = int(query.get("limit") or 0)
        token = query.get("continue")
        with store.cond:
            if token:
                snap = store.snapshots.get(token)
                if snap is None:
                    raise ApiError(410, "Expired", "The provided continue parameter is too old to display a "
                                   "consistent list result. You can start a new list without the continue "
                                   "parameter.")
                rv, items = snap
            else:
                fields, labels = _selector_terms(query.get("fieldSelector")), _selector_terms(
                    query.get("labelSelector"))
                rv = store.rv
                items = [o for k, o in sorted(store.objects[res.plural].items())
                         if (namespace is None or k[0] == namespace) and _matches(o, fields, labels)]
            page, rest = (items[:limit], items[limit:]) if limit else (items, [])
            meta: Obj = {"resourceVersion": str(rv)}
            if rest:
                next_token = base64.urlsafe_b64encode(json.dumps({"rv": rv, "id": uuid.uuid4().hex}).encode())
                meta["continue"] = next_token.decode()
                meta["remainingItemCount"] = len(rest)
                store.snapshots[meta["continue"]] = (rv, rest)
            if token:
                store.snapshots.pop(token, None)
        # Items of a list carry no kind/apiVersion: the list does.
        out = []
        for o in page:
            item = dict(o)
            item.pop("kind", None)
            item.pop("apiVersion", None)
            out.append(item)
        return {"kind": res.kind + "List", "apiVersion": res.api_version, "metadata": meta, "items": out}

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _event(self, event_type: str, obj: Obj) -> None:
        self._chunk(json.dumps({"type": event_type, "object": obj}, separators=(",", ":")).encode() + b"\n")

    def _watch(self, res: Resource, namespace: Optional[str], query: Dict[str, str]) -> None:
        store = self.server.store
        timeout = float(query.get("timeoutSeconds") or 1800)
        deadline = time.monotonic() + timeout
        raw_rv = query.get("resourceVersion") or ""
        w = Watcher(res, 0, _selector_terms(query.get("fieldSelector")), _selector_terms(query.get("labelSelector")),
                    query.get("allowWatchBookmarks") in ("true", "1"), namespace)
        w.sock = self.connection
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        initial: List[Obj] = []
        with store.cond:
            if raw_rv in ("", "0"):
                # Legacy semantics: synthetic ADDED events for the current state, then changes.
                w.position = store.rv
                initial = [o for k, o in sorted(store.objects[res.plural].items()) if self._visible(w, o, k)]
            else:
                w.position = int(raw_rv)
                if w.position < store.compacted:
                    w.expired = True
            store.watchers.append(w)
            store.cond.notify_all()
        try:
            for obj in initial:
                self._event("ADDED", obj)
            self._stream(w, deadline)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass
        finally:
            with store.cond:
                store.watchers.remove(w)
            self.close_connection = True

    def _visible(self, w: Watcher, obj: Obj, key: Key) -> bool:
        return (w.namespace is None or key[0] == w.namespace) and _matches(obj, w.fields, w.labels)

    def _seen(self, w: Watcher, event_type: str, obj: Obj, old: Optional[Obj]) -> List[Tuple[str, Obj]]:
        """What a watcher with selectors sees of one event: a MODIFIED whose object enters the
        selection is ADDED, one that leaves it DELETED (with the new object), as the real server."""
        now = self._visible(w, obj, self._key(obj))
        if event_type == "MODIFIED" and old is not None:
            before = self._visible(w, old, self._key(old))
            if before != now:
                return [("ADDED" if now else "DELETED", obj)]
        return [(event_type, obj)] if now else []

    def _stream(self, w: Watcher, deadline: float) -> None:
        store = self.server.store
        while True:
            with store.cond:
                while True:
                    if w.dropped or store.closed:
                        return  # no terminating chunk: the client sees a broken stream
                    newest = store.rv
                    if w.expired:
                        err = ApiError(410, "Expired", f"too old resource version: {w.position} ({store.compacted})")
                        batch: List[Tuple[str, Obj]] = [("ERROR", err.status())]
                        break
                    start = bisect.bisect_right(store.log_rvs, w.position)
                    batch = [seen for _, p, t, o, old in store.log[start:] if p == w.resource.plural
                             for seen in self._seen(w, t, o, old)]
                    if batch or w.bookmark_due:
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    store.cond.wait(min(left, 0.5))
                if w.bookmark_due and w.bookmarks and not w.expired:
                    batch.append(("BOOKMARK", {"kind": w.resource.kind, "apiVersion": w.resource.api_version,
                                               "metadata": {"resourceVersion": str(newest)}}))
                w.bookmark_due = False
                w.position = newest
            for event_type, obj in batch:
                self._event(event_type, obj)
            if w.expired or (not batch and time.monotonic() >= deadline):
                self._chunk(b"")  # the terminating zero-length chunk: a clean end of stream
                return

    @staticmethod
    def _key(obj: Obj) -> Key:
        meta = obj.get("metadata") or {}
        return (meta.get("namespace", ""), meta.get("name", ""))

    # -- writes ---------------------------------------------------------------------------------

    def _write(self, method: str, res: Resource, namespace: Optional[str], name: Optional[str]) -> Tuple[int, Obj]:
        store = self.server.store
        if method == "GET":
            with store.cond:
                obj = store.objects[res.plural].get((namespace or "", name or ""))
            if obj is None:
                raise ApiError(404, "NotFound", f'{res.plural} "{name}" not found')
            return 200, obj
        if method == "DELETE":
            store.delete(res.plural, namespace or "", name or "")
            return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if res.namespaced:
            body.setdefault("metadata", {}).setdefault("namespace", namespace or "default")
        if method == "POST" and name is None:
            return 201, store.create(res.plural, body)
        if method == "PUT" and name is not None:
            return 200, store.replace(res.plural, body)
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported here")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    store: Store


class ApiServer:
    """The stand-in, serving in a background thread: ``with ApiServer() as api: api.url ...``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, store: Optional[Store] = None) -> None:
        self.store = store or Store()
        self.httpd = _Server((host, port), Handler)
        self.httpd.store = self.store
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                       name="apiserver", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> ApiServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        with self.store.cond:
            self.store.closed = True
            self.store.cond.notify_all()
        self.store.drop_watches()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> ApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # Delegates, so tests read ``api.create(...)``.
    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--port-file", help="write the bound port here once listening")
    parser.add_argument("--load", help="a JSON file: {plural: [objects]} to create at start")
    parser.add_argument("--storm", metavar="RATE:SECONDS", help="after start, replace RATE endpoint slices a "
                        "second for SECONDS (each a random non-empty subset of the addresses the slices hold)")
    parser.add_argument("--storm-start-file", help="begin the storm once this file exists (default: at once)")
    parser.add_argument("--storm-final", help="write the objects as they are after the storm here, as a List "
                        "with a 'changes' count (written last, atomically: its presence says the storm ended)")
    args = parser.parse_args(argv)
    host, port = args.listen.rsplit(":", 1)
    server = ApiServer(host, int(port))
    if args.load:
        with open(args.load) as f:
            for plural, objs in json.load(f).items():
                server.store.bulk_load(plural, objs)
    if args.port_file:
        with open(args.port_file + ".tmp", "w") as f:
            f.write(str(server.httpd.server_address[1]))
        os.replace(args.port_file + ".tmp", args.port_file)
    if args.storm:
        rate, seconds = (float(x) for x in args.storm.split(":"))
        threading.Thread(target=storm, args=(server.store, rate, seconds, args.storm_start_file, args.storm_final),
                         name="storm", daemon=True).start()
    server.httpd.serve_forever(poll_interval=0.2)


def storm(store: Store, rate: float, seconds: float, start_file: Optional[str], final: Optional[str]) -> None:
    """An update storm made inside the server (a client making 1,000 requests a second would measure
    the client): ``rate`` slice replacements a second, at a steady pace, for ``seconds``."""
    import random

    rng = random.Random(7)
    while start_file and not os.path.exists(start_file):
        time.sleep(0.05)
    with store.cond:
        keys = sorted(store.objects["endpointslices"])
        addresses = sorted({a for s in store.objects["endpointslices"].values()
                            for e in s.get("endpoints") or [] for a in e.get("addresses") or []})
    changes, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
        due = int((time.monotonic() - start) * rate)
        while changes < due:
            with store.cond:
                obj = copy.deepcopy(store.objects["endpointslices"][rng.choice(keys)])
            obj["endpoints"] = [{"addresses": [a], "conditions": {"ready": True}}
                                for a in rng.sample(addresses, rng.randint(1, len(addresses)))]
            store.replace("endpointslices", obj)
            changes += 1
        time.sleep(0.002)
    if final:
        with store.cond:
            items = [o for plural in ("services", "endpointslices") for o in store.objects[plural].values()]
            body = json.dumps({"apiVersion": "v1", "kind": "List", "items": items, "changes": changes})
        with open(final + ".tmp", "w") as f:
            f.write(body)
        os.replace(final + ".tmp", final)


if __name__ == "__main__":
    main()
