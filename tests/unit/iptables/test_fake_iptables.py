"""The fake iptables kernel reads restore text as iptables-restore and the kernel do: it holds what
the restore writer's text says, and refuses what they would refuse, so that the unit layer catches
a payload the kernel would reject."""

from __future__ import annotations

from typing import Dict, Tuple

import pytest

from netproxy.backends.base import SyncError
from netproxy.backends.iptables import IptablesBackend, names
from netproxy.backends.iptables.fake import FakeIptables
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Changes
from tests.unit.iptables.test_backend import snapshot, svc_chain

SETUP = "*nat\n:KUBE-A - [0:0]\n:KUBE-B - [0:0]\n-A KUBE-B -j KUBE-A\n-A KUBE-A -j RETURN\nCOMMIT\n"
"""Two chains, KUBE-B jumping to KUBE-A, which holds one rule."""

REFUSED = {
    "unknown table": ("*mangel\nCOMMIT\n", "*mangel"),
    "line outside a table": ("-A KUBE-A -j RETURN\n", "-A KUBE-A -j RETURN"),
    "rule for a chain that does not exist": ("*nat\n-A KUBE-NOPE -j RETURN\nCOMMIT\n", "-A KUBE-NOPE -j RETURN"),
    "jump to a chain that does not exist": ("*nat\n:KUBE-C - [0:0]\n-A KUBE-C -j KUBE-NOPE\nCOMMIT\n",
                                            "-A KUBE-C -j KUBE-NOPE"),
    "goto a target that is not a chain": ("*nat\n-A KUBE-A -g RETURN\nCOMMIT\n", "-A KUBE-A -g RETURN"),
    "jump to a built-in chain": ("*nat\n-A KUBE-A -j PREROUTING\nCOMMIT\n", "-A KUBE-A -j PREROUTING"),
    "chain declared twice": ("*nat\n:KUBE-C - [0:0]\n:KUBE-C - [0:0]\nCOMMIT\n", ":KUBE-C - [0:0]"),
    "policy on a user chain": ("*nat\n:KUBE-C ACCEPT [0:0]\nCOMMIT\n", ":KUBE-C ACCEPT [0:0]"),
    "chain line without a policy": ("*nat\n:KUBE-C\nCOMMIT\n", ":KUBE-C"),
    "chain name too long": (f"*nat\n:KUBE-{'X' * 24} - [0:0]\nCOMMIT\n", f":KUBE-{'X' * 24} - [0:0]"),
    "deleting a chain still jumped to": ("*nat\n:KUBE-A - [0:0]\n-X KUBE-A\nCOMMIT\n", "-X KUBE-A"),
    "deleting a chain that holds rules": ("*nat\n-X KUBE-B\nCOMMIT\n", "-X KUBE-B"),
    "deleting a built-in chain": ("*nat\n-X OUTPUT\nCOMMIT\n", "-X OUTPUT"),
    "deleting a rule that is not there": ("*nat\n-D KUBE-A -j ACCEPT\nCOMMIT\n", "-D KUBE-A -j ACCEPT"),
    "DNAT outside nat": ("*filter\n:KUBE-C - [0:0]\n-A KUBE-C -j DNAT --to-destination 10.0.0.1:80\nCOMMIT\n",
                         "-A KUBE-C -j DNAT --to-destination 10.0.0.1:80"),
    "REJECT in nat": ("*nat\n-A KUBE-A -j REJECT\nCOMMIT\n", "-A KUBE-A -j REJECT"),
    "a jump without its target": ("*nat\n-A KUBE-A -j\nCOMMIT\n", "-A KUBE-A -j"),
    "an unterminated quote": ('*nat\n-A KUBE-A -m comment --comment "open -j RETURN\nCOMMIT\n',
                              '-A KUBE-A -m comment --comment "open -j RETURN'),
    "an unknown command": ("*nat\n-Z KUBE-A\nCOMMIT\n", "-Z KUBE-A"),
    "insertion past the end": ("*nat\n-I KUBE-A 3 -j RETURN\nCOMMIT\n", "-I KUBE-A 3 -j RETURN"),
    "a jump loop (refused at COMMIT)": ("*nat\n-A KUBE-A -j KUBE-B\nCOMMIT\n", "COMMIT"),
    "no COMMIT": ("*nat\n:KUBE-C - [0:0]\n", None),
    "a second table before COMMIT": ("*nat\n:KUBE-C - [0:0]\n*filter\nCOMMIT\n", "*filter"),
}


def state(kernel: FakeIptables) -> Dict[Tuple[int, str], Dict[str, tuple]]:
    return {(f, t): kernel.chains(f, t) for f, t in kernel.tables}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_the_fake_refuses_what_the_kernel_or_the_tool_would_and_changes_nothing(case: str) -> None:
    payload, line = REFUSED[case]
    kernel = FakeIptables()
    kernel.restore(4, SETUP)
    before = state(kernel)
    with pytest.raises(SyncError) as err:
        kernel.restore(4, payload)
    assert err.value.line == line
    assert state(kernel) == before


def test_a_block_committed_before_a_refused_line_stays() -> None:
    kernel = FakeIptables()
    with pytest.raises(SyncError):
        kernel.restore(4, "*filter\n:KUBE-OK - [0:0]\nCOMMIT\n*nat\n:KUBE-C - [0:0]\n-A KUBE-C -j NOPE\nCOMMIT\n")
    assert "KUBE-OK" in kernel.chains(4, "filter") and "KUBE-C" not in kernel.chains(4, "nat")
    assert kernel.chains(6, "filter") == {"INPUT": (), "FORWARD": (), "OUTPUT": ()}  # the other family


def test_it_holds_exactly_what_the_restore_text_says_quoting_included() -> None:
    kernel = FakeIptables()
    comment = 'a "quoted" back\\slash -j DROP'
    kernel.restore(4, "*nat\n:KUBE-C - [0:0]\n:KUBE-D - [0:0]\n"
                      '-A KUBE-C -m comment --comment "a \\"quoted\\" back\\\\slash -j DROP" -j RETURN\n'
                      "[3:180] -A KUBE-C -j KUBE-D\n-I PREROUTING 1 -j KUBE-C\nCOMMIT\n")
    assert kernel.chains(4, "nat")["KUBE-C"] == (("-m", "comment", "--comment", comment, "-j", "RETURN"),
                                                ("-j", "KUBE-D"))
    assert kernel.read(4)["nat"].jumps == {("PREROUTING", "KUBE-C")}
    assert kernel.last(4, "nat").written == {"KUBE-C", "KUBE-D"}
    # What save() prints reads back the same.
    again = FakeIptables()
    again.restore(4, kernel.save(4, "nat"))
    assert again.chains(4, "nat") == kernel.chains(4, "nat")


def test_a_sync_holds_the_rendered_rules() -> None:
    kernel = FakeIptables()
    backend = IptablesBackend(ProxyConfig(hostname="node"), kernel=kernel)
    backend.sync(snapshot(3), Changes(full=True))
    for table in ("nat", "filter"):
        held = kernel.chains(4, table)
        assert {c: held[c] for c in backend._written[4][table]} == backend._written[4][table]


def test_a_partial_sync_the_kernel_refuses_is_caught_and_the_next_sync_is_full() -> None:
    kernel = FakeIptables()
    backend = IptablesBackend(ProxyConfig(hostname="node"), kernel=kernel)
    backend.sync(snapshot(3), Changes(full=True))
    # Another program jumps to one of our chains: the kernel will not delete it.
    kernel.restore(4, f"*nat\n:OTHER - [0:0]\n-A OTHER -j {svc_chain(2)}\nCOMMIT\n")
    before = kernel.chains(4, "nat")
    with pytest.raises(SyncError) as err:
        backend.sync(snapshot(2), Changes(full=False))
    assert err.value.line == f"-X {svc_chain(2)}"
    assert kernel.chains(4, "nat") == before
    with pytest.raises(SyncError):  # a full sync meets the same refusal: still named, still all or nothing
        backend.sync(snapshot(2), Changes(full=False))
    kernel.restore(4, "*nat\n-F OTHER\nCOMMIT\n")
    assert backend.sync(snapshot(2), Changes(full=False)).full
    assert svc_chain(2) not in kernel.chains(4, "nat")


def test_a_second_backend_does_a_full_sync_against_what_the_first_left() -> None:
    kernel = FakeIptables()
    IptablesBackend(ProxyConfig(hostname="node"), kernel=kernel).sync(snapshot(3), Changes(full=True))
    second = IptablesBackend(ProxyConfig(hostname="node"), kernel=kernel)
    second.sync(snapshot(2), Changes(full=True))
    nat = kernel.chains(4, "nat")
    assert svc_chain(2) not in nat and svc_chain(1) in nat
    # The jumps into our chains were found, not added again.
    for hook in ("PREROUTING", "OUTPUT"):
        assert len([r for r in nat[hook] if r[-1] == names.SERVICES]) == 1, hook


def test_cleanup_through_the_fake_removes_ours_and_keeps_the_rest() -> None:
    kernel = FakeIptables()
    backend = IptablesBackend(ProxyConfig(hostname="node"), kernel=kernel)
    backend.sync(snapshot(2), Changes(full=True))
    kernel.restore(4, "*nat\n:DOCKER - [0:0]\n-A DOCKER -j RETURN\n-I PREROUTING 1 -j DOCKER\nCOMMIT\n")
    backend.cleanup()
    nat = kernel.chains(4, "nat")
    assert not [c for c in nat if names.is_owned(c)]
    assert nat["DOCKER"] == (("-j", "RETURN"),) and nat["PREROUTING"] == (("-j", "DOCKER"),)
