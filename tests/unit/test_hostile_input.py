"""Hostile and broken input, property-based (fault 4 of the fault suite): the in-process part, 5,000 cases.

Each case puts one valid service beside an object with one field made hostile (injection strings,
wrong types, out-of-range ports, zone ids...) or a document made hostile (duplicate keys, alias
bombs, wrong document types).  Every case: the hostile object is rejected naming its object and
field, no exception escapes, the message is bounded and on one line, the valid service is rendered,
and nothing of the hostile value is in the iptables-restore text, the nft text or the netlink bytes.
The kernel batch is tests/faults/test_hostile.py.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from contextlib import redirect_stderr
from typing import Any, Dict, Iterator, List, Tuple
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from netproxy import backends, cli
from netproxy.backends import create
from netproxy.backends.fake import FakeBackend
from netproxy.backends.nftables import NftablesBackend, encode
from netproxy.backends.nftables.transaction import full_transaction
from netproxy.core.config import ProxyConfig
from netproxy.core.model import NodeInfo, Snapshot, ValidationError
from netproxy.core.tracker import ChangeTracker
from netproxy.source.files import Loaded, load, parse_objects
from netproxy.source.kube import ServiceHandler, SliceHandler
from tests.unit import hostile_floor
from tests.unit.hostile_cases import (
    GOOD_IP,
    GOOD_POD,
    HOSTILE_IP,
    MARK,
    contains_mark,
    good_service,
    good_slice,
    hostile_case,
    set_field,
    target_object,
)

RUN: Dict[str, int] = {}
"""Cases actually run, per test: hypothesis stops early when a strategy's space is exhausted."""


def cases(n: int) -> Any:
    """``n`` examples; no deadline (the machine is shared); the autouse fixtures are per test, not per
    example, which is right here: they patch modules, they hold no state an example could leak."""
    return settings(max_examples=n, deadline=None, suppress_health_check=[
        HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])


def ran(test: str) -> None:
    RUN[test] = RUN.get(test, 0) + 1
IPT = ProxyConfig(backend="iptables", hostname="node-a")
NFT = ProxyConfig(backend="nftables", hostname="node-a")


def snapshot_of(loaded: Loaded) -> Snapshot:
    tracker = ChangeTracker(NodeInfo(name="node-a"))
    tracker.replace_services(loaded.services)
    tracker.replace_endpoints(loaded.endpoints)
    return tracker.take()[0]


_IPT: List[Any] = []


def iptables_backend() -> Any:
    """One backend for every example (building one costs 6 ms, its plan 0.3 ms); built inside a test,
    after conftest's fixture has swapped the kernel ipsets for the fake."""
    if not _IPT:
        _IPT.append(create("iptables", IPT))
    return _IPT[0]


def rendered(snapshot: Snapshot) -> List[object]:
    """What each writer would send: iptables-restore text, nft text, and nf_tables netlink bytes."""
    ipt = iptables_backend().plan(snapshot)
    nft = NftablesBackend(NFT)
    tx = full_transaction(nft._build_state(snapshot, None), (), NFT)
    messages = [m[3] for m, _ in encode.Encoder().messages(tx.ops)]
    return [ipt, str(tx), *messages]


def has_mark(value: Any) -> bool:
    return MARK in json.dumps(value, default=str)


def norm(path: str) -> str:
    return path.replace("[kubernetes.io/service-name]", ".kubernetes.io/service-name")


def check_error(err: ValidationError, kind: str, ref_name: str, path: str) -> None:
    text = str(err)
    assert "\n" not in text and "\r" not in text, f"a message spans lines: {text!r}"
    assert len(text) < 600, f"an unbounded message ({len(text)} characters)"
    assert err.kind == kind, text
    assert ref_name in err.ref or err.field_path.startswith("metadata."), text
    assert norm(err.field_path) == path, f"{text}: field {err.field_path!r}, attacked {path!r}"


def check_applied_clean(loaded: Loaded) -> None:
    outs = rendered(snapshot_of(loaded))
    assert not contains_mark(outs), f"hostile text reached a ruleset: {contains_mark(outs)}"
    assert GOOD_IP in outs[0] and GOOD_POD in outs[0] and GOOD_IP in outs[1], "the valid service was not rendered"
    assert HOSTILE_IP not in outs[0] + outs[1] or not any(e.kind == "Service" for e in loaded.errors)


def attacked(kind: str, path: str, value: Any) -> List[Dict[str, Any]]:
    return [good_service(), good_slice(), set_field(target_object(kind), path, value)]


# -- 3,000 cases: one field made hostile, straight through the converter and both renderers --------

@cases(3000)
@given(hostile_case())
def test_a_hostile_field_is_rejected_alone_and_never_rendered(case: Tuple[str, str, Any]) -> None:
    ran("test_a_hostile_field_is_rejected_alone_and_never_rendered")
    kind, path, value = case
    loaded = parse_objects(iter(attacked(kind, path, value)), "node-a")
    if has_mark(value):
        assert len(loaded.errors) == 1, f"{kind} {path}={value!r} was not rejected"
        check_error(loaded.errors[0], kind, "victim", path)
    check_applied_clean(loaded)


# -- 1,000 cases: the same through a YAML or JSON file, plus broken documents --------------------

def _write(objs: List[Any], fmt: str, extra: str = "") -> str:
    fd, path = tempfile.mkstemp(suffix=".json" if fmt == "json" else ".yaml")
    with os.fdopen(fd, "w") as f:
        if fmt == "json":
            json.dump({"apiVersion": "v1", "kind": "List", "items": objs}, f)
        else:
            f.write(yaml.safe_dump_all(objs, allow_unicode=True) + extra)
    return path


def _loaded(path: str) -> Loaded:
    """The file loaded as ``run`` loads it, and as the one-shot commands do (no address cache: the
    typed EndpointSlices and the IPv4 shortcut), which must give the same answers."""
    try:
        loaded = load(path, "node-a")
        one_shot = load(path, "node-a", remember_addresses=False)
        assert (one_shot.services, one_shot.endpoints, [str(e) for e in one_shot.errors], one_shot.skipped) == \
            (loaded.services, loaded.endpoints, [str(e) for e in loaded.errors], loaded.skipped)
        return one_shot
    finally:
        os.unlink(path)


@cases(1000)
@given(hostile_case(), st.sampled_from(["yaml", "json"]))
def test_a_hostile_field_in_a_file_is_rejected_alone(case: Tuple[str, str, Any], fmt: str) -> None:
    ran("test_a_hostile_field_in_a_file_is_rejected_alone")
    kind, path, value = case
    if isinstance(value, float) and value != value:
        value = "nan"  # JSON has no NaN; YAML's .nan is covered by the in-process cases
    loaded = _loaded(_write(attacked(kind, path, value), fmt))
    if has_mark(value):
        assert len(loaded.errors) == 1, f"{kind} {path}={value!r} was not rejected"
        check_error(loaded.errors[0], kind, "victim", path)
    check_applied_clean(loaded)


def _bomb(depth: int, width: int) -> str:
    lines = [f"  l0: &l0 [{', '.join(['lol'] * width)}]"]
    lines += [f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, depth)]
    return "\n".join(lines)


BROKEN = {
    # (document text, kind, field)
    "duplicate key": ("kind: Service\nmetadata: {name: victim}\nspec:\n  clusterIP: 10.96.0.66\n"
                      "  clusterIP: 10.96.0.67\n  ports: [{port: 80}]\n", "Service", "spec.clusterIP"),
    "duplicate nested key": ("kind: Service\nmetadata: {name: victim}\nspec:\n  clusterIP: 10.96.0.66\n"
                             "  ports:\n  - port: 80\n    protocol: TCP\n    protocol: UDP\n", "Service",
                             "spec.ports[0].protocol"),
    "duplicate name": ("kind: Service\nmetadata:\n  name: victim\n  name: other\nspec: {clusterIP: 10.96.0.66}\n",
                       "Service", "metadata.name"),
    "alias bomb": ("kind: Service\nmetadata:\n  name: victim\n  annotations:\n" + _bomb(9, 9).replace("  ", "    ")
                   + "\nspec: {clusterIP: 10.96.0.66, ports: [{port: 80}]}\n", "Service", "metadata.annotations.l8"),
    "alias bomb in ports": ("kind: Service\nmetadata: {name: victim}\nx:\n" + _bomb(7, 10)
                            + "\nspec: {clusterIP: 10.96.0.66, ports: *l6}\n", "Service", "x.l6"),
    "a list document": ("- kind: Service\n- 1\n", "document", "(root)"),
    "a scalar document": (f"just a {MARK}\n", "document", "(root)"),
    "wrong spec type": ("kind: Service\nmetadata: {name: victim}\nspec: [1, 2]\n", "Service", "spec"),
    "wrong ports type": ("kind: Service\nmetadata: {name: victim}\nspec: {clusterIP: 10.96.0.66, ports: 80}\n",
                         "Service", "spec.ports"),
    "wrong metadata type": (f"kind: Service\nmetadata: {MARK}\nspec: {{}}\n", "Service", "metadata"),
    "wrong kind type": (f"kind: [Service, {MARK}]\nmetadata: {{name: victim}}\n", "object", "kind"),
    "wrong endpoints type": ("kind: EndpointSlice\nmetadata: {name: victim, labels: "
                             "{kubernetes.io/service-name: good}}\nendpoints: {a: 1}\n", "EndpointSlice", "endpoints"),
    "huge port": (f"kind: Service\nmetadata: {{name: victim}}\nspec: {{clusterIP: 10.96.0.66, ports: [{{port: "
                  f"{'9' * 4000}}}]}}\n", "Service", "spec.ports[0].port"),
    "huge digit target": (f"kind: Service\nmetadata: {{name: victim}}\nspec: {{clusterIP: 10.96.0.66, ports: "
                          f"[{{port: 80, targetPort: '{'9' * 5000}'}}]}}\n", "Service", "spec.ports[0].targetPort"),
    "a 1 MB name": (f"kind: Service\nmetadata: {{name: {'a' * 1_000_000}{MARK}}}\nspec: {{clusterIP: 10.96.0.66}}\n",
                    "Service", "metadata.name"),
}


@cases(400)
@given(st.sampled_from(sorted(BROKEN)), st.integers(min_value=0, max_value=3), st.booleans())
def test_a_broken_document_is_rejected_alone(name: str, position: int, slices_first: bool) -> None:
    ran("test_a_broken_document_is_rejected_alone")
    text, kind, field = BROKEN[name]
    good = [good_slice(), good_service()] if slices_first else [good_service(), good_slice()]
    docs = [yaml.safe_dump(d) for d in good]
    docs.insert(min(position, len(docs)), text)
    fd, path = tempfile.mkstemp(suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        f.write("---\n".join(docs))
    loaded = _loaded(path)
    assert len(loaded.errors) == 1, f"{name}: {loaded.errors}"
    err = loaded.errors[0]
    assert (err.kind, norm(err.field_path)) == (kind, field), f"{name}: {err}"
    assert "\n" not in str(err) and len(str(err)) < 600, str(err)
    check_applied_clean(loaded)


# -- 500 cases: the command line, exit 2 naming the object and field, the rest applied -------------

@cases(500)
@given(hostile_case())
def test_netproxy_sync_exits_2_names_the_field_and_applies_the_rest(case: Tuple[str, str, Any]) -> None:
    ran("test_netproxy_sync_exits_2_names_the_field_and_applies_the_rest")
    kind, path, value = case
    if not has_mark(value):
        value = [MARK]  # the command-line cases all carry the mark: each must be rejected
    made: List[FakeBackend] = []

    def fake(name: str, config: ProxyConfig) -> FakeBackend:
        made.append(FakeBackend(config))
        return made[-1]

    file = _write(attacked(kind, path, value), "yaml")
    err = io.StringIO()
    try:
        # logs.setup would hang a handler on this StringIO when the root logger has none (pytest -p
        # no:logging), and log into it after it is closed: the lines checked here are print()s anyway.
        with mock.patch.object(backends, "create", fake), mock.patch.object(cli.logs, "setup"), redirect_stderr(err):
            code = cli.main(["sync", "--source", file, "--backend", "fake", "--hostname-override", "node-a"])
    finally:
        os.unlink(file)
    lines = err.getvalue().splitlines()
    assert code == 2, err.getvalue()
    assert len(lines) == 1 and lines[0].startswith(f"netproxy: rejected {kind} ") and "Traceback" not in lines[0]
    assert f"field {path.split('.kubernetes.io')[0]}" in norm(lines[0]).replace("[kubernetes.io", ".kubernetes.io")
    state = {str(n): [str(e) for e in eps] for n, (_, eps) in made[0].state.items()}
    assert state.get("default/good:http") == [f"{GOOD_POD}:8080"], state
    assert not contains_mark([repr(made[0].state)])


# -- 500 cases: objects from the API source (the handlers the reflectors feed) --------------------

@cases(600)
@given(hostile_case(), st.sampled_from(["list", "watch"]))
def test_a_hostile_api_object_is_rejected_counted_and_the_rest_applied(case: Tuple[str, str, Any],
                                                                       how: str) -> None:
    ran("test_a_hostile_api_object_is_rejected_counted_and_the_rest_applied")
    kind, path, value = case
    objs = attacked(kind, path, value)
    tracker = ChangeTracker(NodeInfo(name="node-a"))
    services, slices = ServiceHandler(tracker), SliceHandler(tracker, ("IPv4", "IPv6"))
    if how == "list":
        services.replace(iter([o for o in objs if o["kind"] == "Service"]))
        slices.replace(iter([o for o in objs if o["kind"] == "EndpointSlice"]))
    else:
        services.replace(iter(()))
        slices.replace(iter(()))
        for obj in objs:
            (services if obj["kind"] == "Service" else slices).apply("ADDED", obj)
    if has_mark(value):
        assert tracker.rejected == 1, f"{kind} {path}={value!r} was not rejected"
    snap = tracker.take()[0]
    outs = rendered(snap)
    assert not contains_mark(outs) and GOOD_POD in outs[0]


@pytest.fixture(autouse=True)
def _report_cases(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test's case count goes into its report: tests/unit/hostile_floor.py adds up the counts
    of the whole run (xdist spreads this module's tests over its workers) and judges the floor."""
    yield
    ran_here = RUN.get(request.node.name)
    if ran_here:
        request.node.user_properties.append((hostile_floor.PROPERTY, ran_here))


@pytest.fixture(autouse=True)
def _quiet_rejections() -> Iterator[None]:
    """The tracker logs every rejection at error level: thousands of lines, none of them news here."""
    import logging

    logger = logging.getLogger("netproxy.core.tracker")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)
