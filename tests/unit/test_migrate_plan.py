"""``netproxy migrate``'s decisions and failure paths, without a kernel (the kernel test is
tests/kernel/test_migrate.py): what it removes, the order of its steps, what a failure leaves."""

from __future__ import annotations

from typing import List

import pytest

from netproxy.backends.base import SyncError
from netproxy.backends.fake import FakeBackend
from netproxy.backends.iptables import kubeproxy, save
from netproxy.backends.iptables.holdings import classify
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Snapshot
from netproxy.migration.holdings import Holdings, Ruleset
from netproxy.migration.migrate import MigrateError, migrate, plan

KP_IPT = Ruleset("kube-proxy", "iptables", "legacy", (4,), frozenset({"0x4000"}))
KP_NFT = Ruleset("kube-proxy", "nftables", "", (4,), frozenset({"0x4000"}))
NP_IPT = Ruleset("netproxy", "iptables", "legacy", (4, 6), frozenset({"0x4000"}))
NP_NFT = Ruleset("netproxy", "nftables", "", (4,), frozenset({"0x4000"}))
NFT = Ruleset("netproxy", "nftables")
IPT = Ruleset("netproxy", "iptables", "legacy")

KUBE_PROXY_SAVE = """*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:DOCKER-USER - [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-EXTERNAL-SERVICES - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-PROXY-CANARY - [0:0]
:KUBE-SERVICES - [0:0]
-A INPUT -j KUBE-FIREWALL
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes external" -j KUBE-EXTERNAL-SERVICES
-A FORWARD -j DOCKER-USER
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A FORWARD -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A DOCKER-USER -j RETURN
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -j DROP
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SEP-AAAA - [0:0]
:KUBE-MARK-MASQ - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000
COMMIT
"""


def test_plan_removes_the_other_dataplane_of_netproxy_and_keeps_kube_proxy_unless_asked() -> None:
    held = Holdings([NP_IPT, KP_NFT])
    p = plan(held, NFT, from_kube_proxy=False)
    assert p.remove == (NP_IPT,) and p.kept == (KP_NFT,) and p.takeover is None
    p = plan(held, NFT, from_kube_proxy=True)
    assert p.remove == (KP_NFT, NP_IPT) and p.kept == ()


def test_plan_takes_over_kube_proxy_iptables_in_the_same_flavour() -> None:
    held = Holdings([KP_IPT])
    with pytest.raises(MigrateError, match="--from-kube-proxy"):
        plan(held, IPT, from_kube_proxy=False)
    p = plan(held, IPT, from_kube_proxy=True)
    assert p.takeover == KP_IPT and p.remove == (KP_IPT,)
    # Another flavour holds other tables: no shared names, an ordinary switch.
    p = plan(held, Ruleset("netproxy", "iptables", "nft"), from_kube_proxy=True)
    assert p.takeover is None and p.remove == (KP_IPT,)


def test_the_target_itself_is_never_removed() -> None:
    assert plan(Holdings([NP_NFT]), NFT, from_kube_proxy=False).remove == ()
    assert plan(Holdings([NP_NFT, KP_NFT]), NFT, from_kube_proxy=True).remove == (KP_NFT,)


def test_classify_tells_kube_proxy_from_netproxy_by_what_only_kube_proxy_writes() -> None:
    tables = save.parse(KUBE_PROXY_SAVE)
    found = classify({4: tables})
    assert found is not None and found.owner == "kube-proxy" and found.marks == frozenset({"0x4000"})
    del tables["nat"].chains["KUBE-SEP-AAAA"]
    for name in ("KUBE-FORWARD", "KUBE-PROXY-CANARY"):
        del tables["filter"].chains[name]
    found = classify({4: tables})
    assert found is not None and found.owner == "netproxy"
    assert classify({4: save.parse("*nat\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n")}) is None


def test_removal_payload_removes_only_kube_proxy_chains_and_jumps() -> None:
    filt = save.parse(KUBE_PROXY_SAVE)["filter"]
    lines = kubeproxy.removal_payload(filt)
    assert "-X KUBE-FORWARD" in lines and "-X KUBE-SERVICES" in lines and "-X KUBE-PROXY-CANARY" in lines
    assert not [ln for ln in lines if "DOCKER" in ln or "KUBE-FIREWALL" in ln], lines
    assert any(ln.startswith("-D FORWARD ") and ln.endswith("-j KUBE-FORWARD") for ln in lines)
    # Flushed before any rule is deleted, deleted last: the write never references a chain that is gone.
    assert lines.index(":KUBE-FORWARD - [0:0]") < min(i for i, ln in enumerate(lines) if ln.startswith("-D "))
    assert lines[-2].startswith("-X ") and lines[-1] == "COMMIT"


def test_removal_after_a_takeover_keeps_netproxy_chains_and_its_own_jumps() -> None:
    filt = save.parse(KUBE_PROXY_SAVE)["filter"]
    keep = frozenset({"KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES"})
    lines = kubeproxy.removal_payload(filt, keep, frozenset({("FORWARD", "KUBE-SERVICES")}))
    assert "-X KUBE-SERVICES" not in lines and "-X KUBE-EXTERNAL-SERVICES" not in lines
    assert "-X KUBE-FORWARD" in lines
    # kube-proxy's extra entry point into a chain netproxy now fills goes; netproxy's own jump stays.
    assert any(ln.startswith("-D INPUT ") and ln.endswith("-j KUBE-EXTERNAL-SERVICES") for ln in lines)
    assert not any(ln.endswith("-j KUBE-SERVICES") for ln in lines)


class Recorder:
    def __init__(self, fail: str = "") -> None:
        self.removed: List[Ruleset] = []
        self.fail = fail

    def __call__(self, old: Ruleset) -> None:
        if self.fail:
            raise SyncError(self.fail)
        self.removed.append(old)


def _run(backend: FakeBackend, held: Holdings, remover: Recorder, **kw: object) -> object:
    return migrate(backend, backend.config, Snapshot(), held=held, remover=remover, **kw)  # type: ignore[arg-type]


def test_new_first_then_old_and_the_window_is_measured() -> None:
    backend, remover = FakeBackend(), Recorder()
    report = _run(backend, Holdings([KP_NFT]), remover, from_kube_proxy=True)
    assert backend.syncs and backend.syncs[0].full and remover.removed == [KP_NFT]
    assert [s.name for s in report.steps] == ["survey", "program", "verify", "remove"]  # type: ignore[attr-defined]
    assert 0 <= report.overlap_seconds <= report.switch_seconds  # type: ignore[attr-defined]


def test_a_failed_write_leaves_the_old_rules_and_removes_what_it_wrote() -> None:
    backend, remover = FakeBackend(), Recorder()
    backend.fail_next = "-A KUBE-SERVICES bad"
    with pytest.raises(MigrateError) as err:
        _run(backend, Holdings([KP_NFT]), remover, from_kube_proxy=True)
    assert err.value.step == "program" and "untouched" in str(err.value)
    assert remover.removed == [] and backend.cleaned


def test_a_failed_removal_says_the_new_rules_are_in_place() -> None:
    backend = FakeBackend()
    with pytest.raises(MigrateError) as err:
        _run(backend, Holdings([NP_IPT]), Recorder(fail="iptables-restore refused"))
    assert err.value.step == "remove" and "handle new connections" in str(err.value) and not backend.cleaned


def test_a_different_masquerade_bit_is_refused_before_any_write() -> None:
    backend = FakeBackend(ProxyConfig(masquerade_bit=15))
    with pytest.raises(MigrateError, match="--masquerade-bit 14"):
        _run(backend, Holdings([KP_IPT]), Recorder(), from_kube_proxy=True)
    assert backend.syncs == []
