"""Hostile input for the fault suite (fault 4): one valid service beside objects with one field
made hostile, as hypothesis strategies (the in-process tests) and as a seeded batch (the kernel and
API-source tests, which cannot afford a hypothesis run per case).

Every hostile string carries :data:`MARK`, so "nothing of it reached the ruleset" is one substring
check on iptables-restore text, nft text and netlink bytes alike.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

from hypothesis import strategies as st

MARK = "ZZINJ"
Obj = Dict[str, Any]

GOOD_IP, GOOD_POD = "10.96.0.10", "10.244.1.10"
HOSTILE_IP = "10.96.0.66"
"""The hostile service's cluster IP (when that is not the field attacked): never in a ruleset."""

PAYLOADS = (
    '"; flush ruleset; ', "\n-A KUBE-SERVICES -j ACCEPT\n", "' -j ACCEPT '", " -j ACCEPT", "-j ACCEPT",
    "`reboot`", "$(id)", "}", "{ ", ";", "\r\n", "\x00", "\t", "\\", "#", "%eth0", "\u202e", "\u0663",
    " counter accept", "\" comment \"", "x" * 300, "a" * 64,
)

# (kind, dotted path with [i] for lists).  Each is a field netproxy reads; ignored fields are not
# attacked because netproxy never looks at them.
SERVICE_FIELDS = (
    "metadata.name", "metadata.namespace", "spec.type", "spec.clusterIP", "spec.clusterIPs[0]",
    "spec.externalIPs[0]", "spec.loadBalancerSourceRanges[0]", "status.loadBalancer.ingress[0].ip",
    "spec.sessionAffinity", "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
    "spec.externalTrafficPolicy", "spec.internalTrafficPolicy", "spec.trafficDistribution",
    "spec.healthCheckNodePort", "spec.ports[0].name", "spec.ports[0].protocol", "spec.ports[0].port",
    "spec.ports[0].targetPort", "spec.ports[0].nodePort",
)
SLICE_FIELDS = (
    "metadata.name", "metadata.namespace", "metadata.labels.kubernetes.io/service-name", "addressType",
    "ports[0].name", "ports[0].protocol", "ports[0].port", "endpoints[0].addresses[0]",
    "endpoints[0].nodeName", "endpoints[0].zone", "endpoints[0].conditions.ready",
    "endpoints[0].hints.forZones[0].name",
)
PORT_FIELDS = ("port", "targetPort", "nodePort", "healthCheckNodePort", "timeoutSeconds")


def good_service(name: str = "good", ip: str = GOOD_IP) -> Obj:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "default"},
            "spec": {"clusterIP": ip, "ports": [{"name": "http", "port": 80, "targetPort": 8080,
                                                   "protocol": "TCP"}]}}


def good_slice(name: str = "good-a", service: str = "good", ip: str = GOOD_POD) -> Obj:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": "default", "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": [ip], "conditions": {"ready": True}, "nodeName": "node-a",
                           "zone": "z1", "hints": {"forZones": [{"name": "z1"}]}}]}


def target_object(kind: str) -> Obj:
    """The object a field is attacked in: its own service and slice, apart from the good one."""
    if kind == "Service":
        return good_service("victim", HOSTILE_IP)
    return good_slice("victim-a", "good", "10.244.1.66")


def _steps(path: str) -> List[Any]:
    out: List[Any] = []
    for part in path.replace("kubernetes.io/service-name", "\0").split("."):
        part = part.replace("\0", "kubernetes.io/service-name")
        while "[" in part:
            head, _, rest = part.partition("[")
            if head:
                out.append(head)
            index, _, part = rest.partition("]")
            out.append(int(index))
        if part:
            out.append(part)
    return out


def set_field(obj: Obj, path: str, value: Any) -> Obj:
    """A copy of ``obj`` with ``path`` (e.g. ``spec.ports[0].port``) set to ``value``, creating the way."""
    out = copy.deepcopy(obj)
    cur: Any = out
    steps = _steps(path)
    for step, nxt in zip(steps, steps[1:]):
        if isinstance(step, int):
            while len(cur) <= step:
                cur.append({} if isinstance(nxt, str) else [])
            cur = cur[step]
        else:
            if not isinstance(cur.get(step), (dict, list)):
                cur[step] = {} if isinstance(nxt, str) else []
            cur = cur[step]
    last = steps[-1]
    if isinstance(last, int):
        while len(cur) <= last:
            cur.append(None)
    cur[last] = value
    return out


# -- hypothesis strategies -----------------------------------------------------------------------

_printable = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=0x2FF), max_size=12)
hostile_strings = st.builds(lambda pre, payload, post: f"{pre}{payload}{MARK}{post}",
                            st.sampled_from(["", "web", "10.96.0.1", "fe80::1", "80", "TCP", "Cluster"]),
                            st.sampled_from(PAYLOADS), _printable)
bad_ports = st.one_of(st.sampled_from([-1, 65536, 2**31, 2**64, 10**30, True, False, 80.0, 80.5,
                                       float("nan"), float("inf"), "", "0x50", "８０", "80 ", "-1"]),
                      st.integers(min_value=65536), st.integers(max_value=-1))
wrong_types = st.sampled_from([[MARK], {MARK: MARK}, 3.5, [[MARK]], {"a": [MARK]}, ["10.96.0.1", MARK]])
bad_addresses = st.sampled_from([f"fe80::1%eth0{MARK}", f"10.96.0.1%{MARK}", f"10.96.0.1/32{MARK}",
                                 f" 10.96.0.1{MARK}", f"010.096.000.001{MARK}", f"::ffff:10.0.0.1;{MARK}",
                                 f"10.96.0.1\n{MARK}", f"1.2.3.4.5{MARK}", f"[fd00::1]{MARK}"])


@st.composite
def hostile_case(draw: Any) -> Tuple[str, str, Any]:
    """(kind, field path, hostile value) for one attacked field."""
    kind = draw(st.sampled_from(["Service", "EndpointSlice"]))
    path = draw(st.sampled_from(SERVICE_FIELDS if kind == "Service" else SLICE_FIELDS))
    leaf = path.rsplit(".", 1)[-1].split("[")[0]
    choices = [hostile_strings, wrong_types]
    if leaf in PORT_FIELDS:
        choices.append(bad_ports)
    if "IP" in path or leaf == "ip" or "addresses" in path or "Ranges" in path:
        choices.append(bad_addresses)
    return kind, path, draw(st.one_of(choices))


# -- a seeded batch, for tests that run netproxy as a process ---------------------------------------

@dataclass(frozen=True)
class Case:
    kind: str
    path: str
    value: Any
    obj: Obj


def batch(count: int, seed: int) -> List[Case]:
    """``count`` hostile objects, each its own victim (names victim-<i>), deterministic for ``seed``."""
    rng = random.Random(seed)
    out: List[Case] = []
    for i in range(count):
        kind = rng.choice(["Service", "EndpointSlice"])
        fields = SERVICE_FIELDS if kind == "Service" else SLICE_FIELDS
        path = rng.choice([f for f in fields if f != "metadata.name"])
        value: Any = f"{rng.choice(['', 'web', '10.96.0.1'])}{rng.choice(PAYLOADS)}{MARK}{i}"
        if rng.random() < 0.2:
            value = rng.choice([[MARK], {MARK: 1}, 70000, -5, 80.5])
        base = (good_service(f"victim-{i}", f"10.96.1.{i % 250 + 1}") if kind == "Service"
                else good_slice(f"victim-{i}", "good", f"10.244.9.{i % 250 + 1}"))
        out.append(Case(kind, path, value, set_field(base, path, value)))
    return out


def contains_mark(texts: Sequence[object]) -> List[str]:
    """The texts (str or bytes) that contain :data:`MARK`, abbreviated around it."""
    found = []
    for t in texts:
        text = t.decode("latin-1") if isinstance(t, bytes) else str(t)
        at = text.find(MARK)
        if at >= 0:
            found.append(text[max(0, at - 80): at + 40])
    return found
