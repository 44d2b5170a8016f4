"""The netlink writer against its oracles, in throwaway network namespaces.

- Every rule netproxy renders carries the kernel expressions that ``nft --debug=netlink`` shows
  for its text, attribute for attribute (``nft -c``: checked, never committed).
- The same syncs (a full one, then incremental ones of every kind) through the netlink writer and
  through libnftables leave the same ruleset: ``nft -j list ruleset`` and the kernel's own
  expressions and elements (``nft --debug=netlink list ruleset``) are equal after every step.
- A refused batch names the object whose message failed and changes nothing; element lists larger
  than one attribute can hold are split across messages.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, Iterator, List, Tuple

import pytest

from netproxy.backends.nftables import NftablesBackend, encode, wire
from netproxy.backends.nftables.fake import FakeNft
from netproxy.backends.nftables.objects import Rule
from netproxy.backends.nftables.transaction import full_transaction
from netproxy.core.model import Endpoint, ServicePort, ServicePortName, Snapshot
from tests.kernel import nft_scenarios
from tests.kernel.test_nftables_backend import Driver, canonical, nft, nft_env  # noqa: F401 - fixtures

_counter = itertools.count()


@pytest.fixture()
def namespaces(request: pytest.FixtureRequest) -> Iterator[Tuple[str, str]]:
    request.getfixturevalue("nft_env")  # nft and the binding: the oracle needs both
    names = [f"np-nftnl-{os.getpid()}-{next(_counter)}" for _ in range(2)]
    for n in names:
        subprocess.run(["ip", "netns", "add", n], check=True, capture_output=True)
    try:
        yield names[0], names[1]
    finally:
        for n in names:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def _escape(data: bytes) -> str:
    return "".join(chr(b) if 0x20 <= b < 0x7F else f"\\x{b:02x}" for b in data)


def _ours(rule: Rule, family: str) -> List[str]:
    lines = [f"{family} netproxy {rule.chain}"] + [f"  {e.debug()}" for e in rule.exprs]
    if rule.comment is not None:
        text = rule.comment.encode() + b"\0"
        lines.append(f"  userdata = {{ {_escape(bytes((0, len(text))) + text)} }}")
    return lines


_NFT_1_0_BYTEORDER = re.compile(r"^\s*\[ byteorder reg \d+ = hton\(reg \d+, 2, 1\) \]$")
"""The no-op conversion nft < 1.1 put after ``meta l4proto`` in an interval concatenation (nft 1.1
emits none; Debian 13's kernel refuses it): netproxy emits 1.1's sequence, so 1.0's is read without it."""


def _nfts(debug: str) -> List[str]:
    """Rule blocks (header, expressions, user data) of ``nft --debug=netlink`` output."""
    out = []
    inside = False
    for line in debug.splitlines():
        if _NFT_1_0_BYTEORDER.match(line):
            continue
        if re.match(r"^(ip|ip6) netproxy \S+$", line):
            inside = True
            out.append(line)
        elif inside and (line.startswith("  [") or line.startswith("  userdata")):
            out.append(line.rstrip())
        else:
            inside = False
    return out


@pytest.mark.parametrize("config", sorted(nft_scenarios.CONFIGS))
def test_every_rendered_rule_is_the_expression_sequence_nft_emits(namespaces: Tuple[str, str], config: str) -> None:
    ns, _ = namespaces
    cfg = nft_scenarios.CONFIGS[config]
    backend = NftablesBackend(cfg, kernel=FakeNft())
    snapshot, _ = nft_scenarios.steps()[0]
    state = backend._build_state(snapshot, None)
    tx = full_transaction(state, (), cfg)
    with tempfile.NamedTemporaryFile("w", suffix=".nft", delete=False) as f:
        f.write(str(tx))
    try:
        proc = nft(ns, "--debug=netlink", "-c", "-f", f.name)
    finally:
        os.unlink(f.name)
    ours = [line for _, family, obj in tx.ops if isinstance(obj, Rule) for line in _ours(obj, family)]
    assert len(ours) > 60
    assert _nfts(proc.stdout + proc.stderr) == ours


def _objects(listing: str) -> Dict[str, str]:
    """``nft list ruleset`` per table and object, as printed (rule order kept); objects are listed
    in creation order, which two writers need not share."""
    out: Dict[str, str] = {}
    table = key = ""
    for line in listing.splitlines():
        if line.startswith("table "):
            table = line
        elif re.match(r"^\t(set|map|chain) ", line):
            key = f"{table} {line.strip()}"
            out[key] = ""
        elif line.startswith("\t\t") and key:
            out[key] += line + "\n"
        elif line.startswith("\t") and line.strip() != "}":  # the table's own lines (its comment)
            out[table] = out.get(table, "") + line + "\n"
    return {k: "\n".join(ln for ln in v.splitlines() if ln.strip() not in ("", "}")) for k, v in out.items()}


def _kernel_view(ns: str) -> List[str]:
    """What the kernel holds, as nft prints its netlink objects: expressions and element bytes,
    without handles, each object's lines sorted (hash sets list elements in any order)."""
    proc = nft(ns, "--debug=netlink", "list", "ruleset")
    lines = [re.sub(r"^((?:ip|ip6) netproxy \S+)( \d+)+$", r"\1", re.sub(r"\bhandle \d+", "", ln))
             for ln in (proc.stdout + proc.stderr).splitlines()]
    return sorted(ln for ln in lines if ln.strip() and not _NFT_1_0_BYTEORDER.match(ln))


@pytest.mark.parametrize("config", sorted(nft_scenarios.CONFIGS))
def test_both_writers_leave_the_same_ruleset_after_every_step(namespaces: Tuple[str, str], config: str) -> None:
    ns_netlink, ns_text = namespaces
    netlink, text = Driver(ns_netlink, "netlink"), Driver(ns_text, "libnftables")
    try:
        for step in range(len(nft_scenarios.steps())):
            for d in (netlink, text):
                reply = d.call(op="scenario", config=config, step=step)
                assert reply["ok"], (step, reply)
            assert canonical(ns_netlink, "ruleset") == canonical(ns_text, "ruleset"), f"step {step}"
            assert _kernel_view(ns_netlink) == _kernel_view(ns_text), f"step {step}"
            listed = nft(ns_netlink, "list", "ruleset").stdout  # an operator's view: rule order too
            assert "table ip netproxy" in listed and "service-ips" in listed
            assert _objects(listed) == _objects(nft(ns_text, "list", "ruleset").stdout), f"step {step}"
    finally:
        netlink.close()
        text.close()


def test_a_refused_batch_names_the_object_and_changes_nothing(namespaces: Tuple[str, str]) -> None:
    ns, _ = namespaces
    d = Driver(ns, "netlink")
    try:
        services = [{"name": "web", "ip": "10.96.0.10", "eps": ["10.1.0.1", "10.1.0.2"]}]
        assert d.sync(services)["ok"]
        # Behind netproxy's back: the element it will delete on the next change is gone already.
        nft(ns, "delete", "element", "ip", "netproxy", "cluster-tcp-endpoints-2", "{ 10.96.0.10 . 80 . 1 }")
        before = canonical(ns, "ruleset")
        services[0]["eps"] = ["10.1.0.1", "10.1.0.3"]
        reply = d.sync(services, full=False, changed=["web"])
        assert not reply["ok"]
        assert reply["line"] == "delete element ip netproxy cluster-tcp-endpoints-2 { 10.96.0.10 . 80 . 1 }", reply
        assert "No such file or directory" in reply["error"], reply
        assert canonical(ns, "ruleset") == before, "a refused batch must change nothing"
        assert d.sync(services)["ok"], "the next (full) sync repairs"
        listed = nft(ns, "list", "map", "ip", "netproxy", "cluster-tcp-endpoints-2").stdout
        assert "10.1.0.3 . 8080" in listed and "10.1.0.2 . 8080" not in listed
    finally:
        d.close()


def test_element_lists_larger_than_one_attribute_are_split(namespaces: Tuple[str, str]) -> None:
    ns, _ = namespaces
    addrs = [f"10.{1 + i // 250}.{i % 250}.1" for i in range(3000)]
    d = Driver(ns, "netlink")
    try:
        assert d.sync([{"name": "big", "ip": "10.96.0.10", "eps": addrs}])["ok"]
    finally:
        d.close()
    listed = json.loads(nft(ns, "-j", "list", "map", "ip", "netproxy", "cluster-tcp-endpoints-3000").stdout)
    elements = listed["nftables"][1]["map"]["elem"]
    assert sorted(e[1]["concat"][0] for e in elements) == sorted(addrs)
    # The same transaction encoded here: several element messages, none near the 64 KB attribute limit.
    snapshot = Snapshot.build([ServicePort(ServicePortName("default", "big", "p"), "TCP", 80, 8080,
                                           cluster_ips=(ipaddress.ip_address("10.96.0.10"),))],
                              {ServicePortName("default", "big", "p"): tuple(
                                  Endpoint(ipaddress.ip_address(a), 8080) for a in addrs)})
    cfg = nft_scenarios.CONFIGS["default"]
    tx = full_transaction(NftablesBackend(cfg, kernel=FakeNft())._build_state(snapshot, None), (), cfg)
    sizes = [len(m[3]) for m, _ in encode.Encoder().messages(tx.ops) if m[0] == wire.NEWSETELEM]
    assert len(sizes) >= 3 and max(sizes) < 65535, sizes


def test_netlink_writer_needs_no_libnftables(namespaces: Tuple[str, str]) -> None:
    """The default writer imports neither the nftables binding nor libnftables."""
    ns, _ = namespaces
    code = ("import sys; sys.modules['nftables'] = None\n"
            "from netproxy.backends.nftables import NftablesBackend\n"
            "from netproxy.core.config import ProxyConfig\n"
            "from netproxy.core.model import Changes, Snapshot\n"
            "b = NftablesBackend(ProxyConfig(hostname='n')); b.probe(); b.sync(Snapshot({}, {}), Changes())\n"
            "print([m for m in open('/proc/self/maps').read().split() if 'libnftables' in m])\n")
    proc = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
    assert "netproxy" in nft(ns, "list", "tables").stdout
