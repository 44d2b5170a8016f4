"""Version and mode skew (fault 7), in the namespace harness.

- Leftovers of the other mode: netproxy's iptables backend's chains when it starts with nftables,
  its nftables tables when it starts with iptables, kube-proxy's ``kube-proxy`` nftables table (here
  with a DNAT to the wrong pod): each named in one line and removed; traffic then reaches only the
  right endpoints.
- Rules an iptables-nft newer than the node's wrote (made here with nft, which the node's
  iptables-nft reads the same way: "table `nat' is incompatible"): refused in one line, exit 1,
  nothing written beside them.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import List

import pytest

from netproxy_lab.checks import assert_only_and_all
from netproxy_lab.combos import has_iptables
from netproxy_lab.manifests import endpoint_slice, port, service, write_manifests
from netproxy_lab.pytest_plugin import require
from netproxy_lab.topology import NODE_NAME, Sandbox
from tests.faults.figures import figure

pytestmark = pytest.mark.kernel

WEB_IP = "10.96.0.10"
LEGACY = ["--backend", "iptables", "--iptables-flavour", "legacy", "--iptables-writer", "restore"]
IPT_NFT = ["--backend", "iptables", "--iptables-flavour", "nft", "--iptables-writer", "restore"]
NFT = ["--backend", "nftables"]


def sync(sb: Sandbox, source: str, flags: List[str], flavour: str) -> subprocess.CompletedProcess[str]:
    proc: subprocess.CompletedProcess[str] = sb.netproxy(
        ["sync", "--source", source, "--hostname-override", NODE_NAME, *flags], flavour=flavour)
    return proc


def skew_lines(proc: subprocess.CompletedProcess[str]) -> List[str]:
    """The one line per leftover removed after the write (migrate.remove_leftovers), or a refusal."""
    return [ln for ln in proc.stderr.splitlines() if "left from an earlier run" in ln or "cannot read table" in ln]


def test_leftovers_of_the_other_mode_are_named_and_removed(bare_sandbox: Sandbox, tmp_path: object) -> None:
    sb = bare_sandbox
    require(has_iptables("legacy") and shutil.which("nft") is not None, "needs iptables-legacy and nft")
    sb.reset_netfilter()
    source = f"{tmp_path}/c.yaml"
    write_manifests(source, [service("web", WEB_IP, [port(80, 8080, name="http")]),
                             endpoint_slice("web", sb.pods[:2], [port(8080, name="http")])])
    found: List[str] = []

    first = sync(sb, source, LEGACY, "legacy")
    assert first.returncode == 0 and not skew_lines(first), first.stderr[-2000:]
    then = sync(sb, source, NFT, "nft")
    assert then.returncode == 0, then.stderr[-2000:]
    (line,) = skew_lines(then)
    assert "netproxy's iptables-legacy rules" in line and "this node now runs nftables" in line, line
    found.append(line)
    saved = sb.exec(sb.node, ["iptables-legacy-save", "-t", "nat"], check=True).stdout
    assert "KUBE-" not in saved, saved
    assert_only_and_all(sb.connect(WEB_IP, 80, count=60), sb.pods[:2], total=60, at_least=10)

    back = sync(sb, source, LEGACY, "legacy")
    assert back.returncode == 0, back.stderr[-2000:]
    (line,) = skew_lines(back)
    assert "netproxy's nftables rules" in line and "now runs iptables-legacy" in line, line
    found.append(line)
    assert " netproxy" not in sb.exec(sb.node, ["nft", "list", "tables"], check=True).stdout

    # kube-proxy's nftables mode, left behind with a DNAT to a pod that is no endpoint of web.
    wrong = sb.pods[2]
    script = ("table ip kube-proxy {\n chain nat-prerouting {\n  type nat hook prerouting priority -110;\n"
              f"  ip daddr {WEB_IP} tcp dport 80 dnat to {wrong.ip}:8080\n }}\n}}\n")
    sb.exec(sb.node, ["nft", "-f", "-"], check=True, input=script)
    assert sorted(sb.connect(WEB_IP, 80, count=10).counts) == [wrong.name]  # the leftover wins: silently wrong
    again = sync(sb, source, LEGACY, "legacy")
    assert again.returncode == 0, again.stderr[-2000:]
    (line,) = skew_lines(again)
    assert "kube-proxy's nftables rules" in line, line
    found.append(line)
    assert_only_and_all(sb.connect(WEB_IP, 80, count=60), sb.pods[:2], total=60, at_least=10)
    figure("mode skew: leftovers", f"{len(found)} of 3 kinds named in one line each and removed; traffic to the "
           "right endpoints after each", "detected, reported in one line, handled")
    sb.reset_netfilter()


def test_rules_a_newer_iptables_nft_wrote_are_refused(bare_sandbox: Sandbox, tmp_path: object) -> None:
    sb = bare_sandbox
    require(has_iptables("nft") and shutil.which("nft") is not None, "needs iptables-nft and nft")
    sb.reset_netfilter()
    source = f"{tmp_path}/c.yaml"
    write_manifests(source, [service("web", WEB_IP, [port(80, 8080, name="http")]),
                             endpoint_slice("web", sb.pods[:2], [port(8080, name="http")])])
    script = ("table ip nat {\n chain PREROUTING {\n  type nat hook prerouting priority -100;\n"
              "  ip daddr 192.0.2.200 ct state new numgen random mod 2 vmap { 0 : accept, 1 : accept }\n }\n}\n")
    sb.exec(sb.node, ["nft", "-f", "-"], check=True, input=script)
    before = sb.exec(sb.node, ["nft", "list", "table", "ip", "nat"], check=True).stdout
    proc = sync(sb, source, IPT_NFT, "nft")
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and "iptables-nft cannot read table(s) ip nat" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    after = sb.exec(sb.node, ["nft", "list", "table", "ip", "nat"], check=True).stdout
    assert after == before, "netproxy wrote beside rules it cannot read"
    figure("version skew: rules of a newer iptables-nft", f"refused in one line, exit 1, table unchanged: "
           f"{errors[0][:140]}", "detected, reported in one line, refused")
    sb.reset_netfilter()
