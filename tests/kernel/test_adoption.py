"""Restart by adoption in a real kernel (backends/nftables/adopt.py): a new ``netproxy sync`` process
over the tables a previous one wrote writes nothing when nothing changed, only the changed service
when one endpoint changed, and rewrites everything when someone touched the tables in between;
traffic is right after each.  ``nft monitor`` in the node says what each restart wrote."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import List, Optional

import pytest

from netproxy.backends.nftables import names
from netproxy_lab.checks import assert_only_and_all, wait_for
from netproxy_lab.manifests import endpoint_slice, port, service
from netproxy_lab.proxy import Proxy
from netproxy_lab.topology import Sandbox
from tests.kernel.test_nftables_backend import Monitor, canonical
from tests.kernel.webdns import DNS_IP, WEB_IP, cluster

# The nftables backend's restart by adoption (the iptables backend's: test_iptables_adoption.py).
pytestmark = [pytest.mark.kernel, pytest.mark.quick_combos("nftables", "nftables/libnftables"),
              pytest.mark.backends("nftables")]



def committed(monitor: Monitor) -> int:
    """The index of the first ``# new generation ... (python...)`` line after the monitor's opening
    marker: the end of the first netproxy process's commit (netlink delivers a commit's events, then
    its generation; the markers are nft's)."""
    def found() -> int:
        for i in range(monitor.start + 1, len(monitor.lines)):
            if monitor.lines[i].startswith("# new generation") and "(python" in monitor.lines[i]:
                return i
        return -1

    with monitor.cond:
        assert monitor.cond.wait_for(lambda: found() >= 0, 60), monitor.text()
        return found()


def written_after(monitor: Monitor, start: int) -> List[str]:
    """What the kernel reported after line ``start`` and before the closing marker."""
    return [ln for ln in monitor.lines[start + 1:monitor.end]
            if ln.strip() and not ln.startswith("#") and not any(m in ln for m in monitor.marks)]


def test_a_restart_with_the_same_input_writes_nothing(proxy: Proxy, sandbox: Sandbox) -> None:
    objects = cluster(sandbox.pods[:3], sandbox.pods[:2])
    # The monitor opens (with a commit of its own) before the first process: any commit between the
    # two processes would move the generation, and the second one rightly would not adopt.
    with Monitor(sandbox.node) as monitor:
        proxy.sync(objects)
        first = committed(monitor)
        second = proxy.sync(objects)
    assert written_after(monitor, first) == [], f"the second process wrote:\n{monitor.text()}"
    assert "adopted the tables in the kernel" in second.stderr, second.stderr
    res = sandbox.connect(WEB_IP, 80, count=300)
    assert_only_and_all(res, sandbox.pods[:3], total=300, at_least=50)
    res = sandbox.connect(DNS_IP, 53, proto="udp", count=100)
    assert_only_and_all(res, sandbox.pods[:2], total=100, at_least=20)


def test_the_other_writer_adopts_what_this_one_wrote(proxy: Proxy, sandbox: Sandbox) -> None:
    """Both writers write the same objects and stamps (the writer is not in the config digest):
    a restart with ``--nftables-writer`` switched adopts them and commits nothing."""
    objects = cluster(sandbox.pods[:3], sandbox.pods[:2])
    other = "libnftables" if proxy.combo.writer == "netlink" else "netlink"
    with Monitor(sandbox.node) as monitor:
        proxy.sync(objects)
        first = committed(monitor)
        flags = [other if f == proxy.combo.writer else f for f in proxy.combo.flags]  # the same but the writer
        second = proxy.command("sync", "--source", proxy.source, *proxy.base_flags, *flags, combo_flags=False)
    assert second.returncode == 0, second.stderr
    assert "adopted the tables in the kernel" in second.stderr, second.stderr
    assert written_after(monitor, first) == [], f"the {other} writer wrote:\n{monitor.text()}"
    res = sandbox.connect(WEB_IP, 80, count=150)
    assert_only_and_all(res, sandbox.pods[:3], total=150, at_least=20)


def test_a_run_stopped_after_others_commits_restamps_so_the_next_process_adopts(proxy: Proxy,
                                                                               sandbox: Sandbox) -> None:
    """Another program's commit (a table of its own) moves the generation; ``run`` sees in its change
    notifications that it did not touch netproxy's tables and, when it stops (SIGTERM), re-stamps
    them: the next process adopts instead of rewriting."""
    objects = cluster(sandbox.pods[:3], sandbox.pods[:2])
    proxy.start_run(objects)

    def programmed() -> Optional[str]:
        if proxy.running() is False:
            raise AssertionError(proxy.run_output()[-3000:])
        res = sandbox.connect(WEB_IP, 80, count=3, timeout=0.5)
        return None if res.answered == 3 else f"not yet: {res.errors}"

    wait_for(programmed, 20)
    sandbox.exec(sandbox.node, ["nft", "add", "table", "inet", "someone-else"], check=True)
    assert proxy.stop_runs() == [0], proxy.run_output()[-3000:]
    assert "re-stamped the tables" in proxy.run_output(), proxy.run_output()[-3000:]
    second = proxy.sync(objects)
    assert "adopted the tables in the kernel" in second.stderr, second.stderr
    res = sandbox.connect(WEB_IP, 80, count=150)
    assert_only_and_all(res, sandbox.pods[:3], total=150, at_least=20)


def test_one_endpoint_changed_at_a_restart_writes_only_that_service(proxy: Proxy, sandbox: Sandbox) -> None:
    moved = [sandbox.pods[0], sandbox.pods[1], sandbox.pods[3]]
    with Monitor(sandbox.node) as monitor:
        proxy.sync(cluster(sandbox.pods[:3], sandbox.pods[:2]))
        first = committed(monitor)
        second = proxy.sync(cluster(moved, sandbox.pods[:2]))
    events = written_after(monitor, first)
    assert "1 of 2 service ports written" in second.stderr, second.stderr
    assert events, "the changed endpoint was not written"
    for line in events:
        # web's own elements, the hairpin pairs of the pod that left and the one that came, the stamps
        assert (WEB_IP in line or "hairpin" in line or "stamp" in line) and DNS_IP not in line, \
            f"an event outside web's objects:\n{line}\nall events:\n{monitor.text()}"
    assert len(events) <= 12, f"more than web's objects were written:\n{monitor.text()}"
    res = sandbox.connect(WEB_IP, 80, count=300)
    assert_only_and_all(res, moved, total=300, at_least=50)


def test_an_endpoint_deleted_behind_its_back_is_repaired_at_a_restart(proxy: Proxy, sandbox: Sandbox) -> None:
    """The kernel moved its ruleset generation at the ``nft delete element``: the table stamp names
    the generation of netproxy's last commit, so the new process does not adopt, and rewrites."""
    objects = cluster(sandbox.pods[:3], sandbox.pods[:2])
    proxy.sync(objects)
    want = tables(sandbox)
    sandbox.exec(sandbox.node, ["nft", "delete", "element", "ip", "netproxy", "cluster-tcp-endpoints-3",
                                f"{{ {WEB_IP} . 80 . 1 }}"], check=True)
    assert tables(sandbox) != want
    second = proxy.sync(objects)
    assert tables(sandbox) == want, second.stderr
    assert "not adopting them" in second.stderr and "someone committed since" in second.stderr, second.stderr
    res = sandbox.connect(WEB_IP, 80, count=300)
    assert_only_and_all(res, sandbox.pods[:3], total=300, at_least=50)


def tables(sandbox: Sandbox) -> List[str]:
    """Both tables as canonical JSON lines (tests/kernel/test_nftables_backend.py), less the table
    stamp, whose generation is the one thing a rewrite of the same objects changes."""
    return [ln for fam in ("ip", "ip6") for ln in canonical(sandbox.node, "table", fam, "netproxy")
            if '"name": "stamp"' not in ln]


def test_a_full_listing_after_adoption_equals_a_fresh_sync(proxy: Proxy, sandbox: Sandbox) -> None:
    """What an adopting process leaves is what a fresh process writes (every change kind at once)."""
    proxy.sync(cluster(sandbox.pods[:3], sandbox.pods[:2]))
    later = cluster(sandbox.pods[1:3], sandbox.pods[:3])[:2] + [
        service("api", "10.96.0.11", [port(443, 8080, name="https")]),
        endpoint_slice("api", sandbox.pods[:1], [port(8080, name="https")])]
    second = proxy.sync(later)
    assert "adopted the tables in the kernel" in second.stderr, second.stderr
    adopted = tables(sandbox)
    subprocess.run(["ip", "netns", "exec", sandbox.node, "nft", "delete", "table", "ip", "netproxy"], check=True)
    fresh = proxy.sync(later)
    assert "not adopting" in fresh.stderr, fresh.stderr
    assert adopted == tables(sandbox)
    res = sandbox.connect("10.96.0.11", 443, count=20)
    assert_only_and_all(res, sandbox.pods[:1], total=20, at_least=20)


_USES = ("import json; from netproxy.backends.nftables.kernel.nlsocket import NlSocket; "
         "from netproxy.backends.nftables.kernel.readback import chain_uses; "
         "print(json.dumps(chain_uses(NlSocket(), 'ip')))")


def test_the_kernels_chain_use_count_is_rules_plus_what_goes_to_the_chain(proxy: Proxy, sandbox: Sandbox) -> None:
    """What adoption reads to know whether a shared chain keeps a user when changed ports leave it
    (adopt._shared_chains): the kernel's count is the chain's rules plus every rule and verdict-map
    element that jumps or goes to it, counted here from nft's own listing."""
    proxy.sync(cluster(sandbox.pods[:3], sandbox.pods[:2]))
    got = json.loads(sandbox.exec(sandbox.node, [sys.executable, "-c", _USES], check=True).stdout)
    listing = json.loads(sandbox.exec(sandbox.node, ["nft", "-j", "list", "table", "ip", "netproxy"],
                                      check=True).stdout)["nftables"]
    want = {o["chain"]["name"]: 0 for o in listing if "chain" in o}
    for o in listing:
        if "rule" in o:
            want[o["rule"]["chain"]] += 1
    for target in re.findall(r'"(?:goto|jump)": \{"target": "([^"]+)"\}', json.dumps(listing)):
        want[target] += 1
    assert got == want
    assert got["cluster-tcp-pick-3"] == 2  # its one rule and web's cluster IP's element


_BOTH = ("import json; from netproxy.backends.nftables.kernel import readback; "
         "from netproxy.backends.nftables.kernel.nlsocket import NlSocket; "
         "from netproxy.backends.nftables.kernel.netlink import _set_from_attrs; "
         "from netproxy.backends.nftables import encode, names, wire; s = NlSocket(); n = encode.FAMILIES['ip']; "
         "specs = [_set_from_attrs(a) for a in s.dump(wire.GETSET, n, wire.string(wire.SET_TABLE, names.TABLE))]; "
         "print(json.dumps({x.name: [sorted(map(list, readback._plain_elements(s, n, x))), "
         "sorted(map(list, readback._elements(s, n, x)))] for x in specs if x.name in "
         "names.SERVICE_STAMP_SETS + ('stamp', 'cluster-ips', 'hairpin')}))")


def test_the_plain_sets_quick_reader_reads_what_the_general_one_does(proxy: Proxy, sandbox: Sandbox) -> None:
    """readback._plain_elements (one loop over the dump's bytes, for ``service-stamps-*`` at each start)
    against the general reader, in a real kernel, on the plain sets of several key types."""
    proxy.sync(cluster(sandbox.pods[:3], sandbox.pods[:2]))
    both = json.loads(sandbox.exec(sandbox.node, [sys.executable, "-c", _BOTH], check=True).stdout)
    assert set(both) == set(names.SERVICE_STAMP_SETS) | {"stamp", "cluster-ips", "hairpin"}
    for name, (quick, general) in both.items():
        assert quick == general, name
        assert quick or name in names.SERVICE_STAMP_SETS, name  # a few services leave most stamp sets empty
    stamps = [e for name in names.SERVICE_STAMP_SETS for e in both[name][0]]
    assert stamps and all(comment and " d:" in comment for _, _, _, comment, *_ in stamps)
