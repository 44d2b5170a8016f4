"""The restore writer's stream and iptables-legacy-restore's lock alarm (backends/iptables/kernel/restore.py).

iptables-legacy-restore arms ``alarm(<-w>)`` for its xtables-lock wait and never disarms it; the
signal then interrupts its read of stdin and it takes that for the end of the input.  netproxy
streams a payload as it renders it, so a write lasting longer than ``-w`` failed (seen at 100k
services).  Inside a namespace this test creates."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from typing import Iterator

import pytest

from netproxy_lab.pytest_plugin import require

pytestmark = pytest.mark.kernel

CHILD = textwrap.dedent("""
    import sys, time
    from netproxy.backends.iptables.kernel.restore import RestoreTools
    from netproxy.backends.iptables.xtlock import XtablesLock

    def chunks():
        # More than the pipe writer's buffer, so that the tool holds part of the table when the
        # renderer pauses (a payload of 100k services is sent as it is made, 8 KB at a time).
        yield "*filter\\n" + "".join(f":NP-PAD-{i} - [0:0]\\n" for i in range(1000))
        time.sleep(float(sys.argv[1]))  # the renderer is slow: the tool waits on its stdin
        yield ":NP-STREAM - [0:0]\\n-A NP-STREAM -j RETURN\\n"
        yield "COMMIT\\n"

    RestoreTools("legacy", XtablesLock(1.0)).restore_stream(4, chunks)
""")


@pytest.fixture()
def ns() -> Iterator[str]:
    require(shutil.which("iptables-legacy-restore") is not None, "iptables-legacy is not installed")
    name = f"np-stream-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_the_bare_tool_cuts_a_stream_that_outlasts_its_lock_wait(ns: str) -> None:
    """The iptables behaviour the writer works around, shown once: if this starts passing (a fixed
    iptables), the workaround's reason is gone and this test says so."""
    script = "(echo '*filter'; sleep 2.5; echo ':NP-BARE - [0:0]'; echo COMMIT) | iptables-legacy-restore -w 1"
    got = subprocess.run(["ip", "netns", "exec", ns, "sh", "-c", script], capture_output=True, text=True)
    assert got.returncode != 0 and "COMMIT expected" in got.stderr, (got.returncode, got.stderr)


def test_a_stream_slower_than_the_lock_timeout_still_commits(ns: str) -> None:
    got = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", CHILD, "2.5"],
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr[-2000:]
    rules = subprocess.run(["ip", "netns", "exec", ns, "iptables-legacy", "-S", "NP-STREAM"],
                           capture_output=True, text=True, check=True).stdout
    assert "-A NP-STREAM -j RETURN" in rules, rules
