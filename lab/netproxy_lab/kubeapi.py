"""A small JSON client for a real kube-apiserver (and etcd's HTTP gateway) that the lab runs inside a
network namespace: the tests create Services, Pods and Nodes and patch pod status through it, as a
user and a kubelet would.

The control plane listens on the node namespace's loopback (:mod:`netproxy_lab.controlplane`), which
the test process, in the host namespace, cannot reach by address.  Each connection's socket is made
inside the namespace instead: the calling thread enters it with ``setns(2)`` for the one
``socket()``/``connect()`` and comes back at once.  A socket keeps the namespace it was made in, and
``setns`` moves only the calling thread, so nothing else of the process changes namespace.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import os
import socket
import ssl
import urllib.parse
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

Obj = Dict[str, Any]

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def entered(netns: Optional[str]) -> Iterator[None]:
    """The calling thread inside network namespace ``netns`` (``/run/netns/NAME``) for the block; None:
    stay where it is."""
    if not netns:
        yield
        return
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(os.path.join("/run/netns", netns), os.O_RDONLY)
        try:
            _setns(target)
            try:
                yield
            finally:
                _setns(own)
        finally:
            os.close(target)
    finally:
        os.close(own)


def free_port(netns: Optional[str], host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on in ``netns`` now (the kernel's choice; the caller binds it soon)."""
    with entered(netns):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ApiError(RuntimeError):
    """An answer whose status was not the one expected; ``status`` and the server's ``message``."""

    def __init__(self, method: str, path: str, status: int, body: Any) -> None:
        self.status = status
        self.body = body
        self.message = body.get("message", "") if isinstance(body, dict) else str(body)[:500]
        super().__init__(f"{method} {path}: HTTP {status}: {self.message}")


class Client:
    """JSON over HTTP(S) to ``server`` (``https://127.0.0.1:6443``), its sockets made in ``netns``.

    Authenticates with a client certificate (``cert``, ``key``) or a bearer ``token``; trusts ``ca``.
    """

    def __init__(self, server: str, *, netns: Optional[str] = None, ca: Optional[str] = None,
                 cert: Optional[Tuple[str, str]] = None, token: Optional[str] = None, timeout: float = 30) -> None:
        url = urllib.parse.urlsplit(server)
        if url.scheme not in ("http", "https") or not url.hostname or not url.port:
            raise ValueError(f"server {server!r}: want http(s)://HOST:PORT")
        self.server, self.netns, self.timeout = server, netns, timeout
        self.host, self.port, self.tls = url.hostname, url.port, url.scheme == "https"
        self.token = token
        self.context: Optional[ssl.SSLContext] = None
        if self.tls:
            self.context = ssl.create_default_context(cafile=ca)
            if cert:
                self.context.load_cert_chain(*cert)

    def _connection(self, timeout: Optional[float]) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection
        if self.tls:
            conn = http.client.HTTPSConnection(self.host, self.port, timeout=timeout, context=self.context)
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        netns = self.netns

        def create(address: Tuple[str, int], timeout: Optional[float] = None,
                   source_address: Optional[Tuple[str, int]] = None) -> socket.socket:
            with entered(netns):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout)
                sock.connect(address)
            except BaseException:
                sock.close()
                raise
            return sock

        conn._create_connection = create  # type: ignore[attr-defined]  # http.client's hook for the socket
        return conn

    def _headers(self, content_type: str) -> Dict[str, str]:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    @staticmethod
    def _target(path: str, query: Optional[Mapping[str, Any]]) -> str:
        pairs = [(k, str(v).lower() if isinstance(v, bool) else str(v))
                 for k, v in (query or {}).items() if v is not None]
        return path + ("?" + urllib.parse.urlencode(pairs) if pairs else "")

    def call(self, method: str, path: str, body: Any = None, *, query: Optional[Mapping[str, Any]] = None,
             content_type: str = "application/json", expect: Sequence[int] = (200, 201, 202)) -> Any:
        """One request; the decoded JSON answer (text when it is not JSON).  ApiError when the status
        is not in ``expect`` (empty: any status; then the answer is ``(status, body)``)."""
        conn = self._connection(self.timeout)
        target = self._target(path, query)
        try:
            data = json.dumps(body).encode() if body is not None else None
            conn.request(method, target, body=data, headers=self._headers(content_type))
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            doc: Any = json.loads(raw) if raw else None
        except ValueError:
            doc = raw.decode(errors="replace")
        if not expect:
            return resp.status, doc
        if resp.status not in expect:
            raise ApiError(method, target, resp.status, doc)
        return doc

    def get(self, path: str, **query: Any) -> Any:
        return self.call("GET", path, query=query)

    def create(self, path: str, obj: Obj, **query: Any) -> Any:
        return self.call("POST", path, obj, query=query)

    def merge_patch(self, path: str, patch: Obj) -> Any:
        return self.call("PATCH", path, patch, content_type="application/merge-patch+json")

    def delete(self, path: str, **query: Any) -> Any:
        return self.call("DELETE", path, query=query, expect=(200, 202, 404))

    def create_many(self, items: Sequence[Tuple[str, Obj]], workers: int = 8) -> None:
        """POST each ``(collection path, object)``, ``workers`` at a time, each worker on one kept-alive
        connection (a TLS handshake per object would cost more than the object); ApiError on the
        first refusal."""
        import threading

        errors: List[BaseException] = []
        lock = threading.Lock()
        todo = list(reversed(items))

        def worker() -> None:
            conn = self._connection(self.timeout)
            try:
                while not errors:
                    with lock:
                        if not todo:
                            return
                        path, obj = todo.pop()
                    conn.request("POST", path, body=json.dumps(obj).encode(), headers=self._headers("application/json"))
                    resp = conn.getresponse()
                    raw = resp.read()
                    if resp.status not in (200, 201):
                        raise ApiError("POST", path, resp.status, _json_or_text(raw))
            except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
                errors.append(err)
            finally:
                conn.close()

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, workers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def watch(self, path: str, *, timeout: float = 30, **query: Any) -> Iterator[Obj]:
        """The events of a watch (``watch=true`` is added) as they come; ends when the server ends
        the stream or nothing comes for ``timeout`` seconds (socket.timeout)."""
        conn = self._connection(timeout)
        target = self._target(path, {**query, "watch": "true"})
        try:
            conn.request("GET", target, headers=self._headers("application/json"))
            resp = conn.getresponse()
            if resp.status != 200:
                raise ApiError("GET", target, resp.status, _json_or_text(resp.read()))
            while True:
                line = resp.readline()
                if not line:
                    return
                if line.strip():
                    yield json.loads(line)
        finally:
            conn.close()


def _json_or_text(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def items(listed: Obj) -> List[Obj]:
    """A List's items (an empty list answers ``items: null`` in some versions)."""
    return list(listed.get("items") or [])
