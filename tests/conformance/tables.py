"""kube-proxy's packet-flow tables (``tables/<mode>/<Test>.yaml``), read into flows to check.

A table is one test function of kube-proxy's ``pkg/proxy/<mode>/proxier_test.go``: its node (name,
addresses, netproxy flags), its cases (one per subtest, or one), each with its objects (manifests)
and its states (the objects as synced, then e.g. the EndpointSlice deleted), and each state's flows
with kube-proxy's answer.  The format is in ``README.md`` beside this file; anything the loader does
not know is an error naming the file and the field, so a typo cannot drop a flow unnoticed.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import AbstractSet, Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import yaml

HERE = Path(__file__).resolve().parent
TABLES = HERE / "tables"
MODES = ("iptables", "nftables")
PROTOCOLS = ("TCP", "UDP", "SCTP")
SPECIAL = ("DROP", "REJECT", "ACCEPT", "")
"""kube-proxy's non-endpoint answers: dropped, refused, accepted by its filter table (a health-check
node port), untouched (no rule took the packet)."""


class TableError(ValueError):
    pass


@dataclass(frozen=True)
class Answer:
    """Where a flow goes: kube-proxy's ``output`` (endpoints ``ip:port`` sorted and joined by ", ", or
    one of :data:`SPECIAL`) and whether it is masqueraded."""

    output: str
    masq: Optional[bool]
    """None: some of the ways masquerade and some do not (netproxy's answer only; never kube-proxy's)."""

    def __str__(self) -> str:
        shown = self.output or "untouched"
        return {True: f"{shown}, masqueraded", False: shown, None: f"{shown}, masqueraded on some ways"}[self.masq]

    @classmethod
    def of(cls, output: str, masq: Optional[bool]) -> Answer:
        parts = [p.strip() for p in output.split(",")] if output else []
        if len(parts) > 1 or (parts and parts[0] not in SPECIAL):
            return cls(", ".join(sorted(parts)), masq)
        return cls(output, masq)


@dataclass(frozen=True)
class Flow:
    name: str
    source: str
    destination: str
    port: int
    protocol: str
    expect: Answer

    @property
    def key(self) -> str:
        """The flow's name within its state; kube-proxy reuses a name for another protocol once."""
        return f"{self.name} [{self.protocol}]"


@dataclass(frozen=True)
class Node:
    name: str
    addresses: Tuple[str, ...]
    """Every address of the node (what its rules call local)."""
    primary: Tuple[str, ...]
    """Its primary IPs (kube-proxy's ``nodeIP``): netproxy reads them from the Node object's
    InternalIPs, which :meth:`manifest` carries."""
    flags: Tuple[str, ...]

    def manifest(self) -> Mapping[str, Any]:
        """The ``v1 Node`` that tells netproxy this node's name and primary IPs."""
        return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": self.name},
                "status": {"addresses": [{"type": "InternalIP", "address": a} for a in self.primary]}}


@dataclass(frozen=True)
class State:
    """One sync of a case: the case's objects less ``deleted``, and the flows kube-proxy checks then."""

    name: str
    objects: Tuple[Mapping[str, Any], ...]
    flows: Tuple[Flow, ...]

    def manifests(self, node: Node) -> List[Mapping[str, Any]]:
        """What netproxy loads for this state: its objects and the node's ``v1 Node``."""
        return [*self.objects, node.manifest()]


@dataclass(frozen=True)
class Case:
    table: str
    """``<mode>/<Test>``, e.g. ``nftables/TestLoadBalancer``."""
    subtest: str
    node: Node
    states: Tuple[State, ...]

    @property
    def mode(self) -> str:
        return self.table.split("/")[0]


@dataclass(frozen=True)
class Table:
    path: Path
    file: str
    version: str
    test: str
    cases: Tuple[Case, ...] = field(default=())
    objects_from: Optional[str] = None
    """The test function whose objects these are, when the table's own test traces a ruleset written
    out by hand (iptables' TestTracePacket: the ruleset another test expects from these objects)."""

    @property
    def name(self) -> str:
        return f"{self.path.parent.name}/{self.path.stem}"

    def flows(self) -> Iterator[Tuple[Case, State, Flow]]:
        for case in self.cases:
            for state in case.states:
                for flow in state.flows:
                    yield case, state, flow


def flow_id(case: Case, state: State, flow: Flow) -> str:
    """A flow's name across the suite: ``table::subtest::state::flow [PROTO]`` (empty parts left out)."""
    return "::".join(p for p in (case.table, case.subtest, state.name, flow.key) if p)


def load_all() -> List[Table]:
    tables = [load(p) for mode in MODES for p in sorted((TABLES / mode).glob("*.yaml"))]
    if not tables:
        raise TableError(f"no tables under {TABLES}")
    return tables


def load(path: Path) -> Table:
    try:
        doc = yaml.safe_load(path.read_text())
        return _table(path, doc)
    except KeyError as err:
        raise TableError(f"tables/{path.parent.name}/{path.name}: a required field is missing: {err}") from None
    except (TypeError, ValueError, yaml.YAMLError) as err:
        raise TableError(f"tables/{path.parent.name}/{path.name}: {err}") from None


def _table(path: Path, doc: Mapping[str, Any]) -> Table:
    _known(doc, "table", {"kube_proxy", "node", "cases"}, prefix="x-")
    kp = doc["kube_proxy"]
    _known(kp, "kube_proxy", {"file", "version", "test", "objects_from"})
    if path.parent.name not in MODES or f"pkg/proxy/{path.parent.name}/" not in kp["file"]:
        raise TableError(f"a table of {kp['file']} belongs under tables/<its mode>/")
    if kp["test"] != path.stem:
        raise TableError(f"kube_proxy.test {kp['test']!r} is not the file's name")
    node = doc["node"]
    _known(node, "node", {"name", "addresses", "primary", "flags"})
    for a in (*node["addresses"], *node["primary"]):
        ipaddress.ip_address(a)
    name = f"{path.parent.name}/{path.stem}"
    cases = tuple(_case(name, i, c, node) for i, c in enumerate(doc["cases"]))
    origin = kp.get("objects_from")
    table = Table(path, str(kp["file"]), str(kp["version"]), str(kp["test"]), cases,
                  None if origin is None else str(origin))
    seen: Dict[str, int] = {}
    for case, state, flow in table.flows():
        fid = flow_id(case, state, flow)
        seen[fid] = seen.get(fid, 0) + 1
    dup = sorted(k for k, n in seen.items() if n > 1)
    if dup:
        raise TableError(f"flows named twice: {dup}")
    return table


def _case(table: str, index: int, doc: Mapping[str, Any], node: Mapping[str, Any]) -> Case:
    where = f"cases[{index}]"
    _known(doc, where, {"subtest", "flags", "objects", "states"})
    flags = doc.get("flags", node["flags"])
    objects = tuple(doc["objects"])
    states: List[State] = []
    for k, s in enumerate(doc["states"]):
        states.append(_state(f"{where}.states[{k}]", s, objects))
    return Case(table, str(doc.get("subtest") or ""),
                Node(str(node["name"]), tuple(node["addresses"]), tuple(node["primary"]), tuple(str(f) for f in flags)),
                tuple(states))


def _ref(obj: Mapping[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['namespace']}/{obj['metadata']['name']}"


def _state(where: str, doc: Mapping[str, Any], objects: Sequence[Mapping[str, Any]]) -> State:
    _known(doc, where, {"name", "delete", "flows", "overrides"})
    deleted = list(doc.get("delete", ()))
    refs = [_ref(o) for o in objects]
    for ref in deleted:
        if ref not in refs:
            raise TableError(f"{where}.delete: {ref} is not one of the case's objects {refs}")
    kept = tuple(o for o in objects if _ref(o) not in deleted)
    overrides: Dict[str, Mapping[str, Any]] = dict(doc.get("overrides") or {})
    flows: List[Flow] = []
    for i, f in enumerate(doc["flows"]):
        f = dict(f)
        over = overrides.pop(f["name"], None)
        if over is not None:
            _known(over, f"{where}.overrides[{f['name']!r}]", {"expect", "masq"})
            for k, v in over.items():
                if f.get(k, False if k == "masq" else None) == v:
                    raise TableError(f"{where}.overrides[{f['name']!r}].{k} is the flow's own value")
            f.update(over)
        flows.append(_flow(f"{where}.flows[{i}]", f))
    if overrides:
        raise TableError(f"{where}.overrides name no flow: {sorted(overrides)}")
    return State(str(doc.get("name") or ""), kept, tuple(flows))


def _flow(where: str, doc: Mapping[str, Any]) -> Flow:
    _known(doc, where, {"name", "from", "to", "port", "protocol", "expect", "masq"})
    proto = str(doc.get("protocol", "TCP"))
    if proto not in PROTOCOLS:
        raise TableError(f"{where}.protocol: {proto!r} is not one of {PROTOCOLS}")
    for k in ("from", "to"):
        try:
            ipaddress.ip_address(doc[k])
        except ValueError:
            raise TableError(f"{where}.{k}: {doc[k]!r} is not an IP address") from None
    output = str(doc["expect"])
    for part in (p.strip() for p in output.split(",")) if output not in SPECIAL else ():
        host, _, port = part.rpartition(":")
        try:
            ipaddress.ip_address(host.strip("[]"))
            int(port)
        except ValueError:
            raise TableError(f"{where}.expect: {part!r} of {output!r} is not an endpoint ip:port "
                             f"(the answer is endpoints, or one of {SPECIAL})") from None
    masq = doc.get("masq", False)
    if not isinstance(masq, bool):
        raise TableError(f"{where}.masq: {masq!r} is not true or false")
    return Flow(str(doc["name"]), str(doc["from"]), str(doc["to"]), int(doc["port"]), proto, Answer.of(output, masq))


def _known(doc: Any, where: str, keys: AbstractSet[str], prefix: Optional[str] = None) -> None:
    if not isinstance(doc, Mapping):
        raise TableError(f"{where}: a mapping expected, got {type(doc).__name__}")
    unknown = {k for k in doc if k not in keys and not (prefix and str(k).startswith(prefix))}
    if unknown:
        raise TableError(f"{where}: unknown field(s) {sorted(unknown)} (known: {sorted(keys)})")
