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
