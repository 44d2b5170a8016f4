"""Where the kernel itself sends each service address, read from the node's own listing, and where
the input objects say it must: an expectation made without netproxy's code (``plan --diff`` compares
the kernel with netproxy's own plan, so a renderer bug would agree with itself there).

- nftables: ``nft -j list table {ip,ip6} netproxy``. The ``service-ips`` map sends an
  ``address . protocol . port`` to a chain; that chain (and any chain it jumps or goes to) DNATs
  through an endpoints map keyed ``address . port . index`` (``address . port`` for a single
  endpoint), whose elements for this address and port are the endpoints (a random pick must be
  able to draw each index it holds, and only those); a literal ``dnat to`` counts too.
- iptables: ``iptables-<flavour>-save -t nat`` (and ip6tables). From KUBE-SERVICES, through the
  chains its address-range rules jump to, a rule matching one address (/32 or /128), a protocol and
  a port leads to a chain; every ``DNAT --to-destination`` reachable from it is an endpoint.

Node ports, source ranges, traffic policies and affinity are not read here (the traffic suites
cover them); the objects given must not ask for them beyond ClusterIP addresses and ports
(``expected`` refuses what it cannot predict).
"""

from __future__ import annotations

import json
import shlex
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple

from netproxy_lab.combos import Combo
from netproxy_lab.topology import Sandbox

Address = Tuple[str, str, int]
"""(service address, protocol in lower case, port)."""
Endpoints = Dict[Address, FrozenSet[Tuple[str, int]]]


def expected(objects: Sequence[Mapping[str, Any]]) -> Endpoints:
    """Each service address's ready endpoints, from Services and EndpointSlices (ports matched by name)."""
    slices: Dict[Tuple[str, str], List[Mapping[str, Any]]] = {}
    for o in objects:
        if o["kind"] == "EndpointSlice":
            meta = o["metadata"]
            key = (meta.get("namespace", "default"), meta["labels"]["kubernetes.io/service-name"])
            slices.setdefault(key, []).append(o)
    out: Endpoints = {}
    for o in objects:
        if o["kind"] != "Service":
            continue
        spec, meta = o["spec"], o["metadata"]
        unsupported = [f for f in ("externalIPs", "loadBalancerSourceRanges") if spec.get(f)]
        if unsupported or o.get("status", {}).get("loadBalancer", {}).get("ingress"):
            raise ValueError(f"service {meta['name']}: {unsupported or 'load balancer'} not predicted here")
        addresses = spec.get("clusterIPs") or [spec["clusterIP"]]
        for port in spec["ports"]:
            for address in addresses:
                family = "IPv6" if ":" in address else "IPv4"
                chosen: Set[Tuple[str, int]] = set()
                for s in slices.get((meta.get("namespace", "default"), meta["name"]), []):
                    if s.get("addressType", "IPv4") != family:
                        continue
                    numbers = [p["port"] for p in s.get("ports", []) if p.get("name", "") == port.get("name", "")]
                    for e in s.get("endpoints", []):
                        if e.get("conditions", {}).get("ready", True) is not False:
                            chosen.update((e["addresses"][0], n) for n in numbers)
                if chosen:
                    out[(address, port.get("protocol", "TCP").lower(), int(port["port"]))] = frozenset(chosen)
    return out


# ---- nftables ---------------------------------------------------------------------------------


def _concat(value: Any) -> List[Any]:
    return list(value["concat"]) if isinstance(value, dict) and "concat" in value else [value]


def nft_services(listing: Mapping[str, Any]) -> Endpoints:
    """The service addresses of one ``nft -j list table`` and the endpoints the kernel sends them to."""
    maps: Dict[str, List[Any]] = {}
    rules: Dict[str, List[List[Any]]] = {}
    for item in listing["nftables"]:
        if "map" in item:
            maps[item["map"]["name"]] = item["map"].get("elem", [])
        elif "rule" in item:
            rules.setdefault(item["rule"]["chain"], []).append(item["rule"]["expr"])
    out: Endpoints = {}
    for key, verdict in maps.get("service-ips", []):
        address, proto, port = _concat(key["elem"]["val"] if "elem" in key else key)
        target = (verdict.get("goto") or verdict.get("jump") or {}).get("target")
        if target is None:
            continue
        out[(str(address), str(proto), int(port))] = frozenset(_nft_dnats(str(address), int(port), target, maps, rules))
    return out


def _nft_dnats(address: str, port: int, chain: str, maps: Mapping[str, List[Any]],
               rules: Mapping[str, List[List[Any]]], seen: Optional[Set[str]] = None) -> Set[Tuple[str, int]]:
    seen = seen if seen is not None else set()
    if chain in seen:
        return set()
    seen.add(chain)
    out: Set[Tuple[str, int]] = set()
    for exprs in rules.get(chain, []):
        for e in exprs:
            for verb in ("jump", "goto"):
                if verb in e:
                    out |= _nft_dnats(address, port, e[verb]["target"], maps, rules, seen)
            if "dnat" not in e:
                continue
            addr = e["dnat"].get("addr")
            if isinstance(addr, str):
                out.add((addr, int(e["dnat"]["port"])))
                continue
            lookup = addr.get("map", {}) if isinstance(addr, dict) else {}
            fields = _concat(lookup.get("key"))
            if any(isinstance(f, dict) and f.get("payload", {}).get("field") == "saddr" for f in fields):
                continue  # keyed by the client: ClientIP affinity's remembered choices, not the endpoints
            picks = [f["numgen"]["mod"] for f in fields if isinstance(f, dict) and "numgen" in f]
            name = str(lookup["data"]).lstrip("@")
            found = {}
            for key, value in maps.get(name, []):
                k, v = _concat(key), _concat(value)
                if str(k[0]) == address and int(k[1]) == port:
                    found[int(k[2]) if picks else 0] = (str(v[0]), int(v[1]))
            # a random pick must be able to draw each endpoint, and only those: indexes 0 .. mod-1
            assert sorted(found) == list(range(picks[0] if picks else 1)), (
                f"{address}:{port}: chain {chain} picks from {name} (numgen mod {picks or '-'}), which holds "
                f"indexes {sorted(found)}")
            out.update(found.values())
    return out


# ---- iptables ---------------------------------------------------------------------------------


def _option(words: Sequence[str], name: str) -> Optional[str]:
    return words[words.index(name) + 1] if name in words else None


def iptables_services(save: str) -> Endpoints:
    """The service addresses of one ``iptables-save -t nat`` and the endpoints the kernel sends them to."""
    chains: Dict[str, List[List[str]]] = {}
    for line in save.splitlines():
        if line.startswith("-A "):
            words = shlex.split(line)
            chains.setdefault(words[1], []).append(words[2:])
    out: Endpoints = {}
    todo, visited = ["KUBE-SERVICES"], set()
    while todo:
        chain = todo.pop()
        if chain in visited:
            continue
        visited.add(chain)
        for words in chains.get(chain, []):
            dest, target = _option(words, "-d"), _option(words, "-j")
            if dest is None or target is None or target not in chains or words[words.index("-d") - 1] == "!":
                continue
            address, _, length = dest.partition("/")
            dport, proto = _option(words, "--dport"), _option(words, "-p")
            if length in ("32", "128") and dport is not None and proto is not None:
                out[(address, proto, int(dport))] = frozenset(_iptables_dnats(target, chains))
            elif dport is None:  # an address range's chain
                todo.append(target)
    return out


def _iptables_dnats(chain: str, chains: Mapping[str, List[List[str]]],
                    seen: Optional[Set[str]] = None) -> Set[Tuple[str, int]]:
    seen = seen if seen is not None else set()
    if chain in seen:
        return set()
    seen.add(chain)
    out: Set[Tuple[str, int]] = set()
    for words in chains.get(chain, []):
        target = _option(words, "-j")
        if target == "DNAT":
            to = str(_option(words, "--to-destination"))
            host, _, port = to.rpartition(":")
            out.add((host.strip("[]"), int(port)))
        elif target is not None and target in chains:
            out |= _iptables_dnats(target, chains, seen)
    return out


# ---- the node ---------------------------------------------------------------------------------


def kernel_services(sandbox: Sandbox, combo: Combo) -> Endpoints:
    """Both families' service addresses as the node's kernel holds them."""
    node = sandbox.node
    out: Endpoints = {}
    if combo.backend == "nftables":
        for fam in ("ip", "ip6"):
            listed = sandbox.exec(node, ["nft", "-j", "list", "table", fam, "netproxy"])
            if listed.returncode == 0:
                out.update(nft_services(json.loads(listed.stdout)))
        return out
    for tool in ("iptables", "ip6tables"):
        saved = sandbox.exec(node, [f"{tool}-{combo.flavour}-save", "-t", "nat"], check=True).stdout
        out.update(iptables_services(saved))
    return out


def differences(kernel: Endpoints, want: Endpoints) -> Optional[str]:
    """None when the kernel sends exactly the expected addresses to exactly the expected endpoints."""
    lines = []
    for address in sorted(set(kernel) | set(want)):
        have, should = kernel.get(address), want.get(address)
        if have != should:
            lines.append(f"{address}: kernel {sorted(have) if have is not None else 'nothing'}, "
                         f"input {sorted(should) if should is not None else 'nothing'}")
    return "\n".join(lines[:20]) + (f"\n... {len(lines) - 20} more" if len(lines) > 20 else "") if lines else None
