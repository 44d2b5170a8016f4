"""kube-proxy's feature gates, as far as netproxy has the behaviour they switch.

``--feature-gates Name=true,Other=false`` and the ``featureGates`` map of a KubeProxyConfiguration
name them as kube-proxy does; a name netproxy does not know is an error naming it (kube-proxy:
"unrecognized feature gate"), so that a gate an operator relies on is never silently ignored.

Two kinds of gate:

- **switches**: netproxy honours both values (``AllowServiceExternalIPs``);
- **always on**: behaviour netproxy always has (it implements the graduated form only); ``true`` is
  accepted, ``false`` is an error saying so rather than a setting that would not be honoured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Tuple


@dataclass(frozen=True)
class Gate:
    default: bool
    switch: bool
    """False: netproxy always has the behaviour; only ``true`` may be asked for."""
    what: str


GATES: Dict[str, Gate] = {
    "AllowServiceExternalIPs": Gate(True, True, "Services' spec.externalIPs are served; false: they are not "
                                    "(ClusterIPs, NodePorts and load-balancer IPs still are)"),
    "LoadBalancerIPMode": Gate(True, False, "status.loadBalancer.ingress[].ipMode: Proxy skips the VIP's rules"),
    "TopologyAwareHints": Gate(True, False, "EndpointSlice zone hints"),
    "ServiceTrafficDistribution": Gate(True, False, "spec.trafficDistribution (PreferClose)"),
    "PreferSameTrafficDistribution": Gate(True, False, "PreferSameZone, PreferSameNode and node hints"),
    "MultiCIDRServiceAllocator": Gate(True, False, "networking.k8s.io/v1 ServiceCIDR objects"),
    "KubeProxyNFTablesLocalhostNodePorts": Gate(True, True, "nftables: run answers TCP NodePorts on 127.0.0.1 "
                                                "and ::1 through a userspace relay when --nodeport-addresses "
                                                "covers them (1.37 alpha, 1.38 beta and on); false: never"),
}


class GateError(ValueError):
    pass


def parse(text: str) -> Dict[str, bool]:
    """``A=true,B=false`` (kube-proxy's --feature-gates syntax) → {A: True, B: False}."""
    out: Dict[str, bool] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, value = part.partition("=")
        if not sep:
            raise GateError(f"missing bool value for {name.strip()!r}: want Name=true or Name=false")
        v = value.strip().lower()
        if v not in ("true", "false"):
            raise GateError(f"invalid value of {name.strip()}={value.strip()!r}: want true or false")
        out[name.strip()] = v == "true"
    return checked(out)


def checked(gates: Mapping[str, object]) -> Dict[str, bool]:
    """The gates, each known and a bool, and none an always-on one turned off; GateError naming the first
    that is not."""
    out: Dict[str, bool] = {}
    for name, value in gates.items():
        gate = GATES.get(str(name))
        if gate is None:
            raise GateError(f"unrecognized feature gate: {name} (netproxy knows {', '.join(sorted(GATES))})")
        if not isinstance(value, bool):
            raise GateError(f"feature gate {name}: {value!r} is not true or false")
        if not value and not gate.switch:
            raise GateError(f"feature gate {name}=false is not supported: netproxy always has it ({gate.what})")
        out[str(name)] = value
    return out


def effective(gates: Mapping[str, bool]) -> Tuple[Tuple[str, bool], ...]:
    """Every gate's value: the given ones over the defaults, sorted (for /configz and ProxyConfig)."""
    return tuple(sorted({**{n: g.default for n, g in GATES.items()}, **gates}.items()))


def enabled(gates: Tuple[Tuple[str, bool], ...], name: str) -> bool:
    return dict(gates).get(name, GATES[name].default)
