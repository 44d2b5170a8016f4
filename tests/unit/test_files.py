"""The file source: manifests on disk (file, directory, YAML, JSON, lists), and watching them for edits."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, Set, Tuple

import pytest
import yaml

from netproxy.core.model import NodeInfo, ServicePortName
from netproxy.core.tracker import ChangeTracker
from netproxy.source.files import FileSource, Loaded, SourceError, flatten, load, manifest_files, read_documents
from netproxy_lab.manifests import endpoint_slice, service

DATA = Path(__file__).parent / "data"
KUBECTL = DATA / "kubectl-get-svc-eps-A.yaml"
SEED = DATA / "seed-multidoc.yaml"
ip = ipaddress.ip_address


def port_names(loaded: Loaded) -> Set[str]:
    return {str(p.name) for ports in loaded.services.values() for p in ports}


def resolve(loaded: Loaded) -> Dict[str, Tuple[str, ...]]:
    """service port → its endpoints as "ip:port", through the real tracker (as `sync` does)."""
    tracker = ChangeTracker()
    tracker.replace_services(loaded.services)
    tracker.replace_endpoints(loaded.endpoints)
    snap, _ = tracker.take()
    return {str(n): tuple(str(e) for e in snap.endpoints_of(n)) for n in snap.sorted_names()}


def write_yaml(path: Path, *docs: object) -> Path:
    path.write_text(yaml.safe_dump_all(list(docs)), encoding="utf-8")
    return path


# -- what kubectl prints -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster_dump() -> Loaded:
    return load(str(KUBECTL))


def test_get_all_namespaces_output_loads_as_is(cluster_dump: Loaded) -> None:
    loaded = cluster_dump
    assert loaded.errors == []
    assert port_names(loaded) == {"default/kubernetes:https", "kube-system/kube-dns:dns",
                                  "kube-system/kube-dns:dns-tcp", "kube-system/kube-dns:metrics",
                                  "shop/checkout:https"}
    # headless and ExternalName services load without ports; the headless service's slice (labelled
    # service.kubernetes.io/headless by the controller) is skipped, as kube-proxy's informers skip it
    assert loaded.services[("shop", "db")] == () and loaded.services[("shop", "legacy-db")] == ()
    assert set(loaded.endpoints) == {("default", "kubernetes"), ("kube-system", "kube-dns-7hx9t"),
                                     ("shop", "checkout-b8w2q"), ("shop", "checkout-v6k3m")}
    assert loaded.skipped == 1


def test_get_output_resolves_to_the_expected_endpoints(cluster_dump: Loaded) -> None:
    got = resolve(cluster_dump)
    assert got == {
        "default/kubernetes:https": ("172.18.0.2:6443",),
        "kube-system/kube-dns:dns": ("10.244.0.3:53", "10.244.1.4:53", "10.244.1.9:53"),
        "kube-system/kube-dns:dns-tcp": ("10.244.0.3:53", "10.244.1.4:53", "10.244.1.9:53"),
        "kube-system/kube-dns:metrics": ("10.244.0.3:9153", "10.244.1.4:9153", "10.244.1.9:9153"),
        "shop/checkout:https": ("10.244.1.51:8443", "[fd00:10:244:1::51]:8443"),
    }


def test_get_output_fields(cluster_dump: Loaded) -> None:
    loaded = cluster_dump
    (checkout,) = loaded.services[("shop", "checkout")]
    assert checkout.cluster_ips == (ip("10.96.1.40"), ip("fd00:10:96::1:40"))
    assert checkout.load_balancer_ips == (ip("198.51.100.20"),)
    assert (checkout.node_port, checkout.target_port, checkout.external_traffic_policy) == (30443, "https", "Local")
    assert checkout.health_check_node_port == 31234
    dns = loaded.endpoints[("kube-system", "kube-dns-7hx9t")]
    old = [e for e in dns.endpoints if str(e.ip) == "10.244.1.9"][0]
    assert (old.ready, old.serving, old.terminating, old.node_name, old.zone) == (
        False, True, True, "kind-worker", "zone-b")


def test_the_example_cluster_loads_without_rejections() -> None:
    example = Path(__file__).parents[2] / "examples" / "cluster.yaml"
    loaded = load(str(example))
    assert loaded.errors == []
    assert "default/web:http" in port_names(loaded)


# -- formats -----------------------------------------------------------------------------------------

def test_multi_document_yaml_with_legacy_endpoints_node_and_other_kinds() -> None:
    loaded = load(str(SEED), node_name="node-a")
    assert loaded.errors == []
    assert port_names(loaded) == {"infra/cache:redis", "infra/api"}
    assert loaded.node == NodeInfo("node-a", "eu-west-1a")
    got = resolve(loaded)
    assert got["infra/cache:redis"] == ("10.244.3.1:6379", "10.244.3.2:6379", "10.244.3.3:6379")
    cache = [e for e in loaded.endpoints.values() if e.service == "cache"][0]
    assert [(str(e.ip), e.ready) for e in cache.endpoints] == [
        ("10.244.3.1", True), ("10.244.3.2", True), ("10.244.3.3", False)]


def test_legacy_endpoints_only_used_for_services_without_slices() -> None:
    loaded = load(str(SEED))
    api_sets = [e for e in loaded.endpoints.values() if e.service == "api"]
    assert len(api_sets) == 1  # the slice; the legacy Endpoints for api is ignored
    assert [str(e.ip) for e in api_sets[0].endpoints] == ["10.244.3.21"]
    assert resolve(loaded)["infra/api"] == ("10.244.3.21:8080",)


@pytest.mark.parametrize("node_name, expected", [("node-b", NodeInfo("node-b", "eu-west-1b")),
                                                 ("node-z", None), ("", None)])
def test_node_zone_only_for_this_node(node_name: str, expected: object) -> None:
    assert load(str(SEED), node_name=node_name).node == expected


def test_typed_lists_in_json(tmp_path: Path) -> None:
    # ServiceList / EndpointSliceList items carry no kind: the list's kind names it.
    assert "kind" not in json.loads((DATA / "servicelist.json").read_text())["items"][0]
    for name in ("servicelist.json", "endpointslicelist.json"):
        shutil.copy(DATA / name, tmp_path / name)
    loaded = load(str(tmp_path))
    assert loaded.errors == []
    assert resolve(loaded) == {"default/udp-echo": ("10.244.0.81:7", "10.244.0.82:7"),
                               "default/web:http": ("10.244.0.80:8080",)}
    assert loaded.services[("default", "udp-echo")][0].protocol == "UDP"


def test_single_object_json(tmp_path: Path) -> None:
    path = tmp_path / "svc.json"
    path.write_text(json.dumps(service("web", "10.96.0.5")))
    assert port_names(load(str(path))) == {"default/web"}


def test_nested_list_and_kind_in_items_wins() -> None:
    docs = [{"kind": "List", "items": [
        {"kind": "ServiceList", "items": [{"metadata": {"name": "a"}, "spec": {"clusterIP": "10.96.0.1",
                                                                                "ports": [{"port": 1}]}}]},
        service("b", "10.96.0.2"),
    ]}]
    objs = list(flatten(docs))
    assert [(o["kind"], o["metadata"]["name"]) for o in objs] == [("Service", "a"), ("Service", "b")]


def test_a_document_that_is_not_an_object_is_a_source_error(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(SourceError):
        load(str(path))


def test_directory_reads_manifests_sorted_and_skips_others(tmp_path: Path) -> None:
    write_yaml(tmp_path / "b-svc.yaml", service("b", "10.96.0.2"))
    write_yaml(tmp_path / "a-svc.yml", service("a", "10.96.0.1"))
    (tmp_path / "c.json").write_text(json.dumps(endpoint_slice("a", ["10.244.0.1"], name="a-1")))
    (tmp_path / "README.txt").write_text("not: [valid yaml")
    (tmp_path / ".hidden.yaml").write_text("not: [valid yaml")
    assert [os.path.basename(f) for f in manifest_files(str(tmp_path))] == ["a-svc.yml", "b-svc.yaml", "c.json"]
    assert resolve(load(str(tmp_path))) == {"default/a": ("10.244.0.1:8080",), "default/b": ()}


def test_empty_file_loads_nothing(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")
    loaded = load(str(path))
    assert (loaded.services, loaded.endpoints, loaded.errors) == ({}, {}, [])


# -- errors ------------------------------------------------------------------------------------------

def test_a_bad_object_is_rejected_while_its_neighbours_load(tmp_path: Path) -> None:
    bad = service("bad", "10.96.0.9")
    bad["spec"]["ports"][0]["port"] = 70000  # type: ignore[index]
    path = write_yaml(tmp_path / "c.yaml", service("good", "10.96.0.1"), bad,
                      endpoint_slice("good", ["10.244.0.1"], name="good-1"),
                      endpoint_slice("bad", ["10.244.0.300"], name="worse-1"), service("Bad", "10.96.0.10"))
    loaded = load(str(path))
    assert resolve(loaded) == {"default/good": ("10.244.0.1:8080",)}
    got = sorted((e.kind, e.ref, e.field_path) for e in loaded.errors)
    assert got == [("EndpointSlice", "default/worse-1", "endpoints[0].addresses[0]"),
                   ("Service", "default/Bad", "metadata.name"),
                   ("Service", "default/bad", "spec.ports[0].port")]


def test_a_service_defined_twice_is_rejected(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "c.yaml", service("web", "10.96.0.1"), service("web", "10.96.0.2"))
    loaded = load(str(path))
    (err,) = loaded.errors
    assert (err.kind, err.ref) == ("Service", "default/web")
    assert loaded.services[("default", "web")][0].cluster_ips == (ip("10.96.0.1"),)


@pytest.mark.parametrize("name, text", [("broken.yaml", "kind: Service\nmetadata: {name: [unclosed\n"),
                                        ("broken.json", '{"kind": "Service", '),
                                        ("tabs.yaml", "kind: Service\n\tmetadata: {}\n")])
def test_an_unparsable_file_is_a_source_error_naming_it(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(SourceError, match=name.replace(".", r"\.")):
        read_documents(str(path))
    write_yaml(tmp_path / "good.yaml", service("a", "10.96.0.1"))
    with pytest.raises(SourceError):
        load(str(tmp_path))  # one broken file in a directory fails the whole load: no partial state


def test_a_missing_path_is_a_source_error(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no such file"):
        load(str(tmp_path / "nope.yaml"))


# -- FileSource: watching ----------------------------------------------------------------------------

class Watched:
    """A tracker fed by a FileSource, with a way to wait for a condition without fixed sleeps."""

    def __init__(self) -> None:
        self.changed = threading.Event()
        self.tracker = ChangeTracker(on_change=self.changed.set)

    def endpoints(self) -> Dict[str, Tuple[str, ...]]:
        snap, _ = self.tracker.take()
        return {str(n): tuple(str(e) for e in snap.endpoints_of(n)) for n in snap.sorted_names()}

    def wait_for(self, expected: Dict[str, Tuple[str, ...]]) -> None:
        # The exact state, not "something changed": an in-place write passes through an empty file,
        # which is a valid (empty) manifest and may be seen first.
        self.wait(lambda: self.endpoints() == expected)

    def wait(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError("condition not met within the timeout")
            self.changed.wait(min(left, 0.01))  # woken early by the tracker; re-checks otherwise
            self.changed.clear()


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[Tuple[Watched, FileSource, Path]]:
    path = write_yaml(tmp_path / "cluster.yaml", service("web", "10.96.0.1"),
                      endpoint_slice("web", ["10.244.0.1"], name="web-1"))
    w = Watched()
    source = FileSource(str(path), poll_interval=0.005)
    source.start(w.tracker)
    try:
        yield w, source, path
    finally:
        source.stop()


def test_file_source_loads_at_start_and_marks_synced(watched: Tuple[Watched, FileSource, Path]) -> None:
    w, source, _ = watched
    assert w.tracker.ready
    assert source.last_error is None
    assert w.endpoints() == {"default/web": ("10.244.0.1:8080",)}


def test_file_source_picks_up_an_edit(watched: Tuple[Watched, FileSource, Path]) -> None:
    w, _, path = watched
    assert w.endpoints() == {"default/web": ("10.244.0.1:8080",)}
    write_yaml(path, service("web", "10.96.0.1"), endpoint_slice("web", ["10.244.0.1", "10.244.0.22"], name="web-1"),
               service("api", "10.96.0.2"))
    w.wait_for({"default/api": (), "default/web": ("10.244.0.1:8080", "10.244.0.22:8080")})


def test_file_source_picks_up_an_atomic_replace(watched: Tuple[Watched, FileSource, Path]) -> None:
    w, _, path = watched
    w.endpoints()
    tmp = write_yaml(path.with_name(".cluster.yaml.tmp"), service("web", "10.96.0.1"),
                     endpoint_slice("web", ["10.244.0.7"], name="web-1"))
    os.replace(tmp, path)  # how editors and `kubectl ... > f.tmp && mv` replace a file
    w.wait(lambda: w.tracker.pending())  # one atomic step: no intermediate state to see
    assert w.endpoints() == {"default/web": ("10.244.0.7:8080",)}


def test_a_broken_edit_keeps_the_last_good_state(watched: Tuple[Watched, FileSource, Path]) -> None:
    w, source, path = watched
    w.endpoints()
    broken = path.with_name(".broken.tmp")
    broken.write_text("kind: Service\nmetadata: {name: [unclosed\n")
    os.replace(broken, path)
    w.wait(lambda: source.last_error is not None)
    assert "cluster.yaml" in str(source.last_error)
    assert not w.tracker.pending()
    assert w.endpoints() == {"default/web": ("10.244.0.1:8080",)}
    # fixing the file clears the error and applies the new state
    write_yaml(path, service("web", "10.96.0.1"), endpoint_slice("web", ["10.244.0.3"], name="web-1"))
    w.wait_for({"default/web": ("10.244.0.3:8080",)})
    assert source.last_error is None


def test_a_deleted_file_keeps_the_last_good_state(watched: Tuple[Watched, FileSource, Path]) -> None:
    w, source, path = watched
    w.endpoints()
    path.unlink()
    w.wait(lambda: source.last_error is not None)
    assert w.endpoints() == {"default/web": ("10.244.0.1:8080",)}


def test_load_into_counts_rejections(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "c.yaml", service("ok", "10.96.0.1"), service("no", "10.96.0.999"))
    tracker = ChangeTracker()
    loaded = FileSource(str(path)).load_into(tracker)
    assert loaded is not None and len(loaded.errors) == 1
    assert tracker.rejected == 1
    snap, changes = tracker.take()
    assert set(snap.services) == {ServicePortName("default", "ok")}
    assert changes.services == {ServicePortName("default", "ok")}


def test_a_file_that_never_holds_still_is_still_loaded(tmp_path: Path) -> None:
    """An update storm rewrites the file faster than the debounce interval: it must be loaded at least
    every max_settle anyway, not only once the storm ends (fault 5 of the fault suite)."""
    path = tmp_path / "c.yaml"
    write_yaml(path, service("s0", "10.96.0.1"))
    tracker = ChangeTracker()
    source = FileSource(str(path), poll_interval=0.02, max_settle=0.3)
    source.start(tracker)
    stop = threading.Event()

    def storm() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            write_yaml(tmp_path / "next.yaml", service(f"s{i}", "10.96.0.1"))
            os.replace(tmp_path / "next.yaml", path)
            time.sleep(0.004)

    writer = threading.Thread(target=storm)
    writer.start()
    try:
        time.sleep(0.2)  # the storm is on
        first = {k for k in tracker.take()[0].services}
        time.sleep(1.2)
        later = {k for k in tracker.take()[0].services}
        assert later and later != first, "the source did not reload during the storm"
    finally:
        stop.set()
        writer.join()
        source.stop()


def test_the_address_cache_is_filled_from_the_second_read_on(tmp_path: Path) -> None:
    """A one-shot load and run's first read parse addresses without the cache (it would only cost);
    a changed file read again goes through it."""
    from netproxy.core import model

    path = tmp_path / "c.yaml"
    addresses = [f"10.77.{i // 250}.{i % 250 + 1}" for i in range(300)]

    def write(generation: int) -> None:
        path.write_text(yaml.safe_dump_all([service("web", "10.96.0.1"),
                                            endpoint_slice("web", addresses, name=f"web-{generation}")]))

    write(0)
    model.forget_parsed_addresses()
    load(str(path), "", remember_addresses=False)
    assert model._parse_ip.cache_info().currsize <= 1  # the cluster IP (services always go through it)
    source = FileSource(str(path))
    source.load_into(ChangeTracker())
    assert model._parse_ip.cache_info().currsize <= 1, "run's first read fills no cache"
    write(1)
    source.load_into(ChangeTracker())
    assert model._parse_ip.cache_info().currsize >= len(addresses)
    model.forget_parsed_addresses()
