"""Restart by adoption on the iptables backend in a real kernel (backends/iptables/adopt.py), on
iptables-legacy and iptables-nft: a new ``netproxy sync`` process over the tables a previous one wrote
and stamped writes nothing when nothing changed (the rules' packet counters survive: a rewritten
chain starts from zero), only the changed service's chain when one endpoint changed, and rewrites
everything when a rule was edited behind its back or the stamp is gone; traffic is right after each."""

from __future__ import annotations

import re
import shlex
from typing import List, Optional, Sequence

import pytest

from netproxy_lab.checks import assert_only_and_all, wait_for
from netproxy_lab.manifests import write_manifests
from netproxy_lab.proxy import Proxy
from netproxy_lab.topology import Pod, Sandbox
from tests.kernel.webdns import DNS_IP, WEB_IP, cluster

pytestmark = [pytest.mark.kernel, pytest.mark.backends("iptables"),
              pytest.mark.quick_combos("iptables-legacy/restore", "iptables-nft/restore")]

STAMP = "KUBE-NP-STAMP"


def iptables(proxy: Proxy, sandbox: Sandbox, *args: str) -> str:
    return sandbox.exec(sandbox.node, [f"iptables-{proxy.combo.flavour}", *args], check=True).stdout


def saved(proxy: Proxy, sandbox: Sandbox, table: str = "nat", counters: bool = False) -> List[str]:
    """The IPv4 table as ``iptables-save`` prints it (rule lines only; with their counters)."""
    text = sandbox.exec(sandbox.node, [f"iptables-{proxy.combo.flavour}-save", "-t", table,
                                       *(["-c"] if counters else [])], check=True).stdout
    return [ln for ln in text.splitlines() if "-A " in ln]


def web_chain(proxy: Proxy, sandbox: Sandbox) -> str:
    for line in saved(proxy, sandbox):
        m = re.search(r'default/web:http.* -j (KUBE-SVC-\w+)', line)
        if m is not None:
            return m.group(1)
    raise AssertionError("no KUBE-SERVICES rule for web:\n" + "\n".join(saved(proxy, sandbox)))


def test_a_restart_with_the_same_input_writes_nothing(proxy: Proxy, sandbox: Sandbox) -> None:
    objects = cluster(sandbox.pods[:3], sandbox.pods[:2])
    proxy.sync(objects)
    res = sandbox.connect(WEB_IP, 80, count=60)
    assert_only_and_all(res, sandbox.pods[:3], total=60, at_least=5)
    chain = web_chain(proxy, sandbox)
    before = [ln for ln in saved(proxy, sandbox, counters=True) if f"-A {chain} " in ln]
    assert any(not ln.startswith("[0:0]") for ln in before), before  # the traffic counted
    second = proxy.sync(objects)
    assert "IPv4 tables adopted: 0 chains to write, 0 to delete" in second.stderr, second.stderr
    after = [ln for ln in saved(proxy, sandbox, counters=True) if f"-A {chain} " in ln]
    assert after == before, "web's chain was rewritten (its counters started again)"
    res = sandbox.connect(WEB_IP, 80, count=150)
    assert_only_and_all(res, sandbox.pods[:3], total=150, at_least=20)
    res = sandbox.connect(DNS_IP, 53, proto="udp", count=60)
    assert_only_and_all(res, sandbox.pods[:2], total=60, at_least=10)


def test_one_endpoint_changed_at_a_restart_writes_only_that_chain(proxy: Proxy, sandbox: Sandbox) -> None:
    moved = [sandbox.pods[0], sandbox.pods[1], sandbox.pods[3]]
    proxy.sync(cluster(sandbox.pods[:3], sandbox.pods[:2]))
    second = proxy.sync(cluster(moved, sandbox.pods[:2]))
    assert "IPv4 tables adopted: 1 chains to write, 0 to delete" in second.stderr, second.stderr
    res = sandbox.connect(WEB_IP, 80, count=200)
    assert_only_and_all(res, moved, total=200, at_least=30)
    res = sandbox.connect(DNS_IP, 53, proto="udp", count=60)
    assert_only_and_all(res, sandbox.pods[:2], total=60, at_least=10)
    third = proxy.sync(cluster(moved, sandbox.pods[:2]))  # the adopting process stamped what it wrote
    assert "IPv4 tables adopted: 0 chains to write" in third.stderr, third.stderr


def test_a_rule_edited_behind_its_back_is_repaired_at_a_restart(proxy: Proxy, sandbox: Sandbox) -> None:
    """``iptables -R`` of web's last endpoint rule to another pod: the rule count and every chain stay,
    only the tables' fingerprint (legacy) or the nf_tables generation (nft) shows it."""
    objects = cluster(sandbox.pods[:3], sandbox.pods[:2])
    proxy.sync(objects)
    want = saved(proxy, sandbox)
    chain = web_chain(proxy, sandbox)
    rules = [ln for ln in want if ln.startswith(f"-A {chain} ")]
    last = rules[-1].replace(sandbox.pods[2].ip, sandbox.pods[3].ip)
    assert last != rules[-1], rules
    iptables(proxy, sandbox, "-t", "nat", "-R", chain, str(len(rules)), *shlex.split(last)[2:])
    assert saved(proxy, sandbox) != want
    second = proxy.sync(objects)
    assert "IPv4 tables not adopted, rewriting them all: the tables changed since netproxy stamped them" \
        in second.stderr, second.stderr
    if proxy.combo.flavour == "legacy":  # same entry count and size: the headers hold, the fingerprint tells
        assert "(stamp fp:" in second.stderr and "their headers" not in second.stderr, second.stderr
    assert saved(proxy, sandbox) == want
    res = sandbox.connect(WEB_IP, 80, count=200)
    assert_only_and_all(res, sandbox.pods[:3], total=200, at_least=30)


def test_a_foreign_chain_means_a_full_rewrite_that_leaves_it(proxy: Proxy, sandbox: Sandbox) -> None:
    """Another program's chain in nat since the stamp (``iptables -N``): on legacy the table's header
    (entry count, size) is no longer the stamp's, which the new process sees before it reads the
    tables (no fingerprint walk); on iptables-nft the generation moved.  Everything of ours is
    rewritten, the foreign chain stays, and the next process adopts."""
    objects = cluster(sandbox.pods[:3], sandbox.pods[:2])
    proxy.sync(objects)
    want = saved(proxy, sandbox)
    iptables(proxy, sandbox, "-t", "nat", "-N", "NP-FOREIGN")
    second = proxy.sync(objects)
    reason = "their headers" if proxy.combo.flavour == "legacy" else "the tables changed since netproxy stamped them"
    assert "IPv4 tables not adopted, rewriting them all: the tables changed since netproxy stamped them" \
        in second.stderr and reason in second.stderr, second.stderr
    assert saved(proxy, sandbox) == want
    assert "NP-FOREIGN" in iptables(proxy, sandbox, "-t", "nat", "-S", "NP-FOREIGN")
    third = proxy.sync(objects)
    assert "IPv4 tables adopted: 0 chains to write" in third.stderr, third.stderr
    res = sandbox.connect(WEB_IP, 80, count=150)
    assert_only_and_all(res, sandbox.pods[:3], total=150, at_least=20)


def test_a_deleted_rule_is_repaired_at_a_restart(proxy: Proxy, sandbox: Sandbox) -> None:
    objects = cluster(sandbox.pods[:3], sandbox.pods[:2])
    proxy.sync(objects)
    want = saved(proxy, sandbox)
    iptables(proxy, sandbox, "-t", "nat", "-D", web_chain(proxy, sandbox), "1")
    second = proxy.sync(objects)
    assert "IPv4 tables not adopted" in second.stderr, second.stderr
    assert saved(proxy, sandbox) == want
    res = sandbox.connect(WEB_IP, 80, count=150)
    assert_only_and_all(res, sandbox.pods[:3], total=150, at_least=20)


def test_a_flushed_stamp_means_a_full_rewrite(proxy: Proxy, sandbox: Sandbox) -> None:
    objects = cluster(sandbox.pods[:3], sandbox.pods[:2])
    proxy.sync(objects)
    want = saved(proxy, sandbox)
    iptables(proxy, sandbox, "-t", "mangle", "-F", STAMP)
    second = proxy.sync(objects)
    assert f"IPv4 tables not adopted, rewriting them all: the {STAMP} chain is empty" in second.stderr, \
        second.stderr
    assert saved(proxy, sandbox) == want
    assert saved(proxy, sandbox, "mangle"), f"the rewrite stamped the tables again:\n{second.stderr}"
    third = proxy.sync(objects)
    assert "IPv4 tables adopted: 0 chains to write" in third.stderr, third.stderr
    res = sandbox.connect(WEB_IP, 80, count=150)
    assert_only_and_all(res, sandbox.pods[:3], total=150, at_least=20)


def test_a_run_stopped_after_partial_syncs_stamps_so_the_next_process_adopts(proxy: Proxy,
                                                                            sandbox: Sandbox) -> None:
    """``run`` does not stamp its partial writes (the stamp of its first sync then no longer matches);
    at SIGTERM, with nobody else having written nat or filter, it stamps the tables as they are."""
    moved = [sandbox.pods[0], sandbox.pods[1], sandbox.pods[3]]
    proxy.start_run(cluster(sandbox.pods[:3], sandbox.pods[:2]))

    def reaches(pods: Sequence[Pod]) -> Optional[str]:
        if proxy.running() is False:
            raise AssertionError(proxy.run_output()[-3000:])
        res = sandbox.connect(WEB_IP, 80, count=30, timeout=0.5)
        return None if res.answered == 30 and set(res.counts) <= {p.name for p in pods} else f"not yet: {res.counts}"

    wait_for(lambda: reaches(sandbox.pods[:3]), 20)
    write_manifests(proxy.source, cluster(moved, sandbox.pods[:2]))  # a partial sync of web's chain
    wait_for(lambda: reaches(moved), 20)
    assert proxy.stop_runs() == [0], proxy.run_output()[-3000:]
    assert "stamped the tables at exit" in proxy.run_output(), proxy.run_output()[-3000:]
    second = proxy.sync(cluster(moved, sandbox.pods[:2]))
    assert "IPv4 tables adopted: 0 chains to write, 0 to delete" in second.stderr, second.stderr
    res = sandbox.connect(WEB_IP, 80, count=150)
    assert_only_and_all(res, moved, total=150, at_least=20)


def test_cleanup_removes_the_stamp(proxy: Proxy, sandbox: Sandbox) -> None:
    proxy.sync(cluster(sandbox.pods[:3], sandbox.pods[:2]))
    assert any(STAMP in ln for ln in saved(proxy, sandbox, "mangle"))
    proxy.cleanup()
    text = sandbox.exec(sandbox.node, [f"iptables-{proxy.combo.flavour}-save", "-t", "mangle"], check=True).stdout
    assert STAMP not in text, text
