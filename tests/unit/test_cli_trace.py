"""``netproxy trace`` on both backends: each walks its own rendered rules, and they must agree."""

from __future__ import annotations

import re
from pathlib import Path
from typing import List

import pytest

from netproxy import cli

EXAMPLE = str(Path(__file__).parents[1].parent / "examples" / "cluster.yaml")
CASES = [
    ["--to", "10.96.0.10:80"],                                          # ClusterIP, 3 endpoints
    ["--to", "10.96.0.53:53", "--protocol", "udp", "--from", "10.244.1.5"],
    ["--to", "10.96.2.10:3000"],                                        # no endpoints: rejected
    ["--to", "10.96.0.10:81"],                                          # unknown port of a ClusterIP
    ["--to", "192.0.2.77:80"],                                          # not a service
    ["--to", "198.51.100.20:443"],                                      # an external IP
]


def _verdicts(backend: str, case: List[str], capsys: pytest.CaptureFixture[str]) -> List[str]:
    code = cli.main(["trace", "--source", EXAMPLE, "--backend", backend, "--hostname-override", "node-a",
                     "--iptables-flavour", "legacy", *case])
    out = capsys.readouterr().out
    assert code == 0, out
    # The share and the verdict; the chains on the way are each backend's own.
    return sorted(re.sub(r"\s+via .*$", "", line).strip() for line in out.splitlines()[1:])


@pytest.mark.parametrize("case", CASES, ids=[c[1] for c in CASES])
def test_iptables_and_nftables_traces_agree(case: List[str], capsys: pytest.CaptureFixture[str]) -> None:
    ipt, nft = _verdicts("iptables", case, capsys), _verdicts("nftables", case, capsys)
    assert ipt == nft and ipt


def test_iptables_trace_names_chains_and_shares(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["trace", "--source", EXAMPLE, "--backend", "iptables", "--hostname-override", "node-a",
                     "--iptables-flavour", "legacy", "--to", "10.96.0.10:80"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert len(rows) == 3 and all(r.strip().startswith("33.3%  DNAT to 10.244.") for r in rows)
    assert all("nat/KUBE-SERVICES > nat/KUBE-SVC-" in r for r in rows)


# --detect-local-mode: the same packet is a local pod's (source kept) or not (masqueraded) by its
# source address or by the interface it came in on; both backends must say the same.
LOCAL_MODE_CASES = {
    "cidr-pod": (["--cluster-cidr", "10.244.0.0/16"], ["--from", "10.244.1.5"], "source kept"),
    "cidr-other": (["--cluster-cidr", "10.244.0.0/16"], ["--from", "172.16.0.9"], "masqueraded"),
    "bridge-pod": (["--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", "cbr0"],
                   ["--from", "172.16.0.9", "--from-interface", "cbr0"], "source kept"),
    "bridge-other": (["--detect-local-mode", "BridgeInterface", "--pod-bridge-interface", "cbr0"],
                     ["--from", "10.244.1.5", "--from-interface", "cbr01"], "masqueraded"),
    "prefix-pod": (["--detect-local-mode", "InterfaceNamePrefix", "--pod-interface-name-prefix", "veth"],
                   ["--from", "172.16.0.9", "--from-interface", "veth1a2b"], "source kept"),
    "prefix-other": (["--detect-local-mode", "InterfaceNamePrefix", "--pod-interface-name-prefix", "veth"],
                     ["--from", "10.244.1.5", "--from-interface", "eth0"], "masqueraded"),
    "prefix-node": (["--detect-local-mode", "InterfaceNamePrefix", "--pod-interface-name-prefix", "veth"],
                    ["--from", "10.244.1.5", "--from-node", "--from-interface", "veth0"], "masqueraded"),
}


@pytest.mark.parametrize("name", LOCAL_MODE_CASES)
def test_detect_local_mode_traces_agree_and_masquerade_only_non_local_sources(
        name: str, capsys: pytest.CaptureFixture[str]) -> None:
    flags, packet, source = LOCAL_MODE_CASES[name]
    case = ["--to", "10.96.0.10:80", *flags, *packet]
    ipt, nft = _verdicts("iptables", case, capsys), _verdicts("nftables", case, capsys)
    assert ipt == nft and len(ipt) == 3
    assert all(line.endswith(source) for line in ipt), ipt


def test_localhost_nodeport_answers_on_iptables_only(capsys: pytest.CaptureFixture[str]) -> None:
    """kube-proxy's iptables mode serves NodePorts on 127.0.0.1 (--iptables-localhost-nodeports,
    default true); its nftables mode never does."""
    case = ["--to", "127.0.0.1:30443", "--from", "127.0.0.1", "--from-node"]
    ipt, nft = _verdicts("iptables", case, capsys), _verdicts("nftables", case, capsys)
    assert ipt and all("DNAT to 10.244." in line and line.endswith("masqueraded") for line in ipt), ipt
    assert not any("DNAT" in line for line in nft), nft
    off = _verdicts("iptables", [*case, "--iptables-localhost-nodeports=false"], capsys)
    assert not any("DNAT" in line for line in off), off
