"""Version and mode skew (fault 7 of the fault suite), with the node's tools answered by a table of outputs."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import pytest

from netproxy.backends.base import BackendUnavailable
from netproxy.core.config import ProxyConfig
from netproxy.node import skew

LEGACY_NAT = "*nat\n:PREROUTING ACCEPT [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-ABC - [0:0]\nCOMMIT\n"


def node(outputs: Dict[str, str]) -> skew.Run:
    def run(argv: Sequence[str]) -> Optional[str]:
        return outputs.get(" ".join(argv))
    return run


def lines(found: List[skew.Finding]) -> List[str]:
    return [f.line for f in found]


def test_a_clean_node_has_no_findings() -> None:
    run = node({"nft list tables": "table ip nat\ntable ip filter\n"})
    assert skew.findings("nftables", ProxyConfig(), run) == []
    assert skew.findings("iptables", ProxyConfig(iptables_flavour="nft"), run) == []


def test_rules_a_newer_iptables_nft_wrote_are_refused_in_one_line() -> None:
    run = node({"iptables-nft-save": "# Table `nat' is incompatible, use 'nft' tool.\n",
                "ip6tables-nft-save": "# Table `mangle' is incompatible, use 'nft' tool.\n"})
    (found,) = skew.findings("iptables", ProxyConfig(iptables_flavour="nft"), run)
    assert found.fix is None and "ip nat" in found.line and "mangle" not in found.line
    assert "\n" not in found.line
    with pytest.raises(BackendUnavailable, match="iptables-nft cannot read table"):
        skew.settle("iptables", ProxyConfig(iptables_flavour="nft"), run)
    # The legacy flavour and the nftables backend do not go through iptables-nft: nothing to refuse.
    assert skew.findings("iptables", ProxyConfig(iptables_flavour="legacy"), run) == []
    assert skew.findings("nftables", ProxyConfig(), run) == []


def test_leftovers_are_not_skew_findings() -> None:
    """Leftovers of the other mode are removed after the first write (migrate.remove_leftovers), never
    before it: a finding here would run before netproxy's rules are in place."""
    run = node({"iptables-legacy-save -t nat": LEGACY_NAT,
                "nft list tables": "table ip netproxy\ntable ip6 netproxy\ntable ip kube-proxy\n"})
    assert skew.findings("nftables", ProxyConfig(), run) == []
    assert skew.findings("iptables", ProxyConfig(iptables_flavour="legacy"), run) == []
