"""netproxy in a sandbox's node, run the way one backend/writer combination runs it: sync, run,
cleanup, and what the node's tables hold afterwards."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import List, Mapping, Optional, Sequence

from netproxy_lab.cleanup import stop_netproxy
from netproxy_lab.combos import Combo, has_iptables
from netproxy_lab.manifests import Manifest, write_manifests
from netproxy_lab.topology import NODE_NAME, Sandbox


class Proxy:
    """netproxy in the sandbox's node, run with one combination's flags."""

    def __init__(self, sandbox: Sandbox, combo: Combo, workdir: str) -> None:
        self.sandbox, self.combo = sandbox, combo
        self.workdir = workdir
        self.source = os.path.join(workdir, "cluster.yaml")
        self.run_log = ""
        self._runs: List[subprocess.Popen] = []  # type: ignore[type-arg]
        # /run/xtables.lock is one file for every namespace of the machine: other test runs' legacy
        # writes (a 10k-rule bench) may hold it for longer than the 5 s default, which would fail a
        # one-shot sync here for a reason outside the test.  tests/faults/test_lock.py tests the default.
        self.base_flags = ["--hostname-override", NODE_NAME, "--iptables-lock-timeout", "60s"]

    def command(self, verb: str, *extra: str, combo_flags: bool = True) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
        args = [verb, *extra, *(self.combo.flags if combo_flags else [])]
        return self.sandbox.netproxy(args, flavour=self.combo.path_flavour)

    def sync(self, objects: Sequence[Manifest], *, expect: int = 0) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
        """Write ``objects`` as the source and run ``netproxy sync``; asserts the exit status."""
        write_manifests(self.source, objects)
        proc = self.command("sync", "--source", self.source, *self.base_flags)
        assert proc.returncode == expect, _explain(f"sync exited {proc.returncode}, expected {expect}", proc)
        return proc

    def cleanup(self, *, expect: int = 0) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
        proc = self.command("cleanup")
        assert proc.returncode == expect, _explain(f"cleanup exited {proc.returncode}", proc)
        return proc

    def start_run(self, objects: Sequence[Manifest], *extra: str,
                  env: Optional[Mapping[str, str]] = None) -> subprocess.Popen:  # type: ignore[type-arg]
        """``netproxy run --source FILE`` in the background; stopped after the test."""
        write_manifests(self.source, objects)
        self.run_log = os.path.join(self.workdir, f"run-{len(self._runs)}.log")
        args = ["run", "--source", self.source, "--metrics-bind-address", "", *self.base_flags, *self.combo.flags]
        proc = self.sandbox.start_netproxy([*args, *extra], flavour=self.combo.path_flavour, log_path=self.run_log,
                                           env=env)
        self._runs.append(proc)
        return proc

    def run_output(self) -> str:
        """The latest ``run``'s log so far (its stdout and stderr)."""
        try:
            with open(self.run_log, errors="replace") as f:
                return f.read()
        except (OSError, AttributeError):
            return ""

    def running(self) -> Optional[bool]:
        """Whether the latest ``run`` is alive (None: none started)."""
        return self._runs[-1].poll() is None if self._runs else None

    def stop_runs(self) -> List[int]:
        """SIGTERM every ``run`` this proxy started; their exit codes."""
        codes = [stop_netproxy(proc, timeout=15) for proc in self._runs]
        self._runs.clear()
        return [code for code in codes if code is not None]

    def ruleset(self) -> str:
        """What an operator would read: ``iptables-<flavour>-save`` (v4 and v6) and ``nft list ruleset``."""
        parts = []
        if has_iptables(self.combo.flavour):
            for tool in (f"iptables-{self.combo.flavour}-save", f"ip6tables-{self.combo.flavour}-save"):
                parts.append(self.sandbox.exec(self.sandbox.node, [tool], check=True).stdout)
        if shutil.which("nft"):
            parts.append(self.sandbox.exec(self.sandbox.node, ["nft", "list", "ruleset"], check=True).stdout)
        return "\n".join(parts)

    def reset(self) -> None:
        self.stop_runs()
        self.sandbox.reset_netfilter()


def _explain(headline: str, proc: subprocess.CompletedProcess) -> str:  # type: ignore[type-arg]
    return f"{headline}\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
