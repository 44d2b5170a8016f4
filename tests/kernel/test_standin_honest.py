"""The API stand-in (lab/netproxy_lab/apiserver.py) kept honest: every behaviour it imitates for
netproxy's source is asked of it and of the real kube-apiserver (``make control-plane``) the same way,
and the answers compared — paging with ``limit``/``continue``, label and field selectors, watch events
(a change across a watch's selector included), bookmarks, and the 404, 403 and 410 answers.

The stand-in stays for the faults a real server cannot be made to produce on demand (an outage that
cuts connections unanswered, slow answers, injected 500s); this is what keeps its ordinary answers
the real server's.  The real server runs in a namespace of its own (loopback only), the stand-in in
this process on 127.0.0.1.
"""

from __future__ import annotations

import secrets
import subprocess
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import pytest

from netproxy_lab.apiserver import ApiServer
from netproxy_lab.cleanup import delete_namespace
from netproxy_lab.controlplane import ControlPlane, Unavailable
from netproxy_lab.kubeapi import ApiError, Client, Obj
from netproxy_lab.pytest_plugin import require

pytestmark = [pytest.mark.kernel, pytest.mark.controlplane]

NS = "cmp"
SERVICES = "/api/v1/namespaces/cmp/services"
PROXY_FILTER = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"


class Pair:
    """The same requests to both servers: ``real`` (a :class:`Client` as cluster-admin) and ``standin``."""

    def __init__(self, cp: ControlPlane, standin: ApiServer) -> None:
        self.cp, self.server = cp, standin
        self.real = cp.admin
        self.standin = Client(standin.url)

    def both(self) -> List[Tuple[str, Client]]:
        return [("real", self.real), ("stand-in", self.standin)]


@pytest.fixture(scope="module")
def pair(kernel_env: None) -> Iterator[Pair]:
    netns = f"np-cmp-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    try:
        subprocess.run(["ip", "-n", netns, "link", "set", "lo", "up"], check=True)
        try:
            cp = ControlPlane(netns)
        except Unavailable as err:
            require(False, f"no control plane: {err}")
            raise
        with cp, ApiServer() as standin:
            cp.ensure_namespace(NS)
            p = Pair(cp, standin)
            for i, labels in enumerate([{"app": "web"}, {"app": "web"}, {"app": "web"}, {"app": "db"},
                                        {"app": "web", "service.kubernetes.io/service-proxy-name": "other"},
                                        {}]):
                for _, client in p.both():
                    client.create(SERVICES, service(f"s{i}", f"10.96.1.{10 + i}", labels))
            yield p
    finally:
        delete_namespace(netns)


def service(name: str, ip: str, labels: Dict[str, str]) -> Obj:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": NS, "labels": labels},
            "spec": {"clusterIP": ip, "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]}}


def names(listed: Obj) -> List[str]:
    return [o["metadata"]["name"] for o in listed.get("items") or []]


def both_equal(pair: Pair, ask: Callable[[Client], Any]) -> Any:
    """``ask`` of both servers; asserts the answers are equal; the answer."""
    real, standin = ask(pair.real), ask(pair.standin)
    assert real == standin, f"real server: {real}\nstand-in:    {standin}"
    return real


def test_paging_with_limit_and_continue(pair: Pair) -> None:
    def pages(client: Client) -> List[Tuple[str, str, List[str], Optional[int], bool, bool]]:
        out, token = [], None
        while True:
            page = client.get(SERVICES, limit=2, **({"continue": token} if token else {}))
            meta = page["metadata"]
            kinds = {"kind" in o or "apiVersion" in o for o in page["items"]}
            out.append((page["kind"], page["apiVersion"], names(page), meta.get("remainingItemCount"),
                        bool(meta.get("resourceVersion")), True in kinds))
            token = meta.get("continue")
            if not token:
                return out
    got = both_equal(pair, pages)
    assert [p[2] for p in got] == [["s0", "s1"], ["s2", "s3"], ["s4", "s5"]], got


@pytest.mark.parametrize("selector", ["app=web", "app!=web", "app", "!app", PROXY_FILTER, "app=web,app!=db"])
def test_label_selectors(pair: Pair, selector: str) -> None:
    both_equal(pair, lambda c: sorted(names(c.get(SERVICES, labelSelector=selector))))


def test_field_selector_on_the_name(pair: Pair) -> None:
    assert both_equal(pair, lambda c: names(c.get(SERVICES, fieldSelector="metadata.name=s3"))) == ["s3"]


def replace(client: Client, name: str, change: Callable[[Obj], None]) -> None:
    obj = client.get(f"{SERVICES}/{name}")
    change(obj)
    client.call("PUT", f"{SERVICES}/{name}", obj)


def test_watch_events_and_a_change_across_the_selector(pair: Pair) -> None:
    """From a list's version: an object created (ADDED), one relabelled out of the selector (DELETED, as
    the watch cache filters), one annotated (MODIFIED), one deleted (DELETED)."""
    def run(client: Client) -> List[Tuple[str, str]]:
        rv = client.get(SERVICES, labelSelector="app=web")["metadata"]["resourceVersion"]
        seen: List[Tuple[str, str]] = []

        def watch() -> None:
            for event in client.watch(SERVICES, labelSelector="app=web", resourceVersion=rv, timeoutSeconds=8,
                                      timeout=15):
                if event["type"] != "BOOKMARK":
                    seen.append((event["type"], event["object"]["metadata"]["name"]))
                if len(seen) == 4:
                    return
        t = threading.Thread(target=watch)
        t.start()
        client.create(SERVICES, service("w-new", "10.96.1.40", {"app": "web"}))
        replace(client, "s0", lambda o: o["metadata"]["labels"].update(app="db"))
        replace(client, "s1", lambda o: o["metadata"].setdefault("annotations", {}).update(note="x"))
        client.delete(f"{SERVICES}/s2")
        t.join(20)
        # Put things back for the other tests.
        client.delete(f"{SERVICES}/w-new")
        replace(client, "s0", lambda o: o["metadata"]["labels"].update(app="web"))
        client.create(SERVICES, service("s2", "10.96.1.12", {"app": "web"}))
        return seen
    assert both_equal(pair, run) == [("ADDED", "w-new"), ("DELETED", "s0"), ("MODIFIED", "s1"), ("DELETED", "s2")]


def test_bookmarks(pair: Pair) -> None:
    """A BOOKMARK carries the kind, the apiVersion and a resourceVersion only.  The real server sends
    one about a minute into a watch (none before a 15 s watch's timeout, tried), the stand-in when a
    test asks (``bookmark()``): the first of each is compared."""
    def first_bookmark(client: Client, poke: Callable[[], None]) -> Optional[Tuple[str, str, List[str]]]:
        rv = client.get(SERVICES)["metadata"]["resourceVersion"]
        timer = threading.Timer(1.0, poke)
        timer.start()
        t0 = time.monotonic()
        try:
            for event in client.watch(SERVICES, resourceVersion=rv, allowWatchBookmarks=True, timeoutSeconds=100,
                                      timeout=110):
                if event["type"] == "BOOKMARK":
                    obj = event["object"]
                    assert int(obj["metadata"]["resourceVersion"]) >= int(rv)
                    print(f"{client.server}: first BOOKMARK after {time.monotonic() - t0:.1f} s")
                    return obj["kind"], obj["apiVersion"], sorted(obj["metadata"])
        finally:
            timer.cancel()
        return None
    real = first_bookmark(pair.real, lambda: None)
    standin = first_bookmark(pair.standin, pair.server.bookmark)
    assert real == standin == ("Service", "v1", ["resourceVersion"]), (real, standin)


def status_of(call: Callable[[], Any], who: str = "") -> Tuple[int, str, str]:
    try:
        answer = call()
    except ApiError as err:
        body = err.body if isinstance(err.body, dict) else {}
        return err.status, str(body.get("kind")), str(body.get("reason"))
    raise AssertionError(f"{who} answered 2xx: {str(answer)[:300]}")


def test_not_found(pair: Pair) -> None:
    got = both_equal(pair, lambda c: status_of(lambda: c.get(f"{SERVICES}/nope")))
    assert got == (404, "Status", "NotFound")


def test_forbidden(pair: Pair) -> None:
    """403 from RBAC (a ServiceAccount bound to nothing) and the stand-in's refusal: the same Status."""
    cp = pair.cp
    cp.admin.create("/api/v1/namespaces/cmp/serviceaccounts",
                    {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "nobody"}})
    token = cp.admin.create("/api/v1/namespaces/cmp/serviceaccounts/nobody/token",
                            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                             "spec": {"expirationSeconds": 600}})["status"]["token"]
    nobody = cp.client(cp.server, token=token)
    pair.server.unserved["endpointslices"] = 403
    path = "/apis/discovery.k8s.io/v1/endpointslices"
    try:
        real = status_of(lambda: nobody.get(path), "real")
        standin = status_of(lambda: pair.standin.get(path), "stand-in")
    finally:
        del pair.server.unserved["endpointslices"]
    assert real == standin == (403, "Status", "Forbidden"), (real, standin)


def test_gone_for_an_old_continue_token_and_an_old_watch_version(pair: Pair) -> None:
    """After compaction (and, for the real server, a restart: see below): a continue token of an older
    list answers 410 Expired; a watch from a version older than the server keeps answers 200 and then
    an ERROR event carrying a 410 Expired Status."""
    def gone(client: Client, compact: Callable[[], object]) -> Tuple[Tuple[int, str, str], List[Tuple[str, Any, Any]]]:
        first = client.get(SERVICES, limit=1)
        old_rv = first["metadata"]["resourceVersion"]
        # Writes after it, so that compaction leaves its version behind.
        for i in range(3):
            client.create(SERVICES, service(f"g{i}", f"10.96.1.{50 + i}", {"app": "gone"}))
            client.delete(f"{SERVICES}/g{i}")
        compact()
        listed = status_of(lambda: client.get(SERVICES, limit=1, **{"continue": first["metadata"]["continue"]}))
        events = [(e["type"], e["object"].get("code"), e["object"].get("reason"))
                  for e in client.watch(SERVICES, resourceVersion=old_rv, timeoutSeconds=3, timeout=10)]
        return listed, events[:1]
    def compact_and_restart() -> None:
        # v1.36.3 serves a continue token from its watch cache's snapshot even after etcd compacted its
        # version (tried: 200 and the next page); the 410 comes once the snapshot is gone with the cache.
        pair.cp.compact_etcd()
        pair.cp.kill_apiserver()
        pair.cp.start_apiserver("apiserver")
    real = gone(pair.real, compact_and_restart)
    standin = gone(pair.standin, pair.server.compact)
    assert real == standin, f"real server: {real}\nstand-in:    {standin}"
    assert real == ((410, "Status", "Expired"), [("ERROR", 410, "Expired")]), real

