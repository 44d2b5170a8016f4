"""The driver's side of the lab's traffic: what a batch of connections saw, a batch still running, and
one long-lived connection.  The connections themselves are made by :mod:`netproxy_lab.client`,
a subprocess inside a namespace (:meth:`netproxy_lab.topology.Sandbox.connect`).
"""

from __future__ import annotations

import json
import select
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Dict, List

from netproxy_lab.client import Result


class SandboxError(RuntimeError):
    """Building the sandbox, or running something in it, failed."""


@dataclass
class ConnectResult(Result):
    """What one client batch saw: the client's own :class:`~netproxy_lab.client.Result`, read back
    from its JSON, with the sums the tests ask for."""

    @property
    def answered(self) -> int:
        return sum(self.counts.values())

    @property
    def failed(self) -> int:
        return sum(self.errors.values())

    def source_addresses(self) -> Dict[str, int]:
        """Source addresses seen by the pods, summed over pods."""
        out: Dict[str, int] = {}
        for per_pod in self.sources.values():
            for addr, n in per_pod.items():
                out[addr] = out.get(addr, 0) + n
        return out


class PendingConnect:
    """A client batch still running; :meth:`result` waits for it."""

    def __init__(self, proc: subprocess.Popen, budget: float,  # type: ignore[type-arg]
                 on_done: Callable[[subprocess.Popen], None]) -> None:  # type: ignore[type-arg]
        self.proc = proc
        self.budget = budget
        self._on_done = on_done

    def wait_started(self, timeout: float = 60.0) -> None:
        """Until the batch (started with ``announce=True``) has finished its first attempt."""
        assert self.proc.stderr is not None
        ready, _, _ = select.select([self.proc.stderr], [], [], timeout)
        line = self.proc.stderr.readline() if ready else b""
        if line.strip() != b"started":
            raise SandboxError(f"the client did not start within {timeout:.0f}s: {line!r}")

    def wait_outcome(self, wanted: Callable[[str], bool], timeout: float = 60.0) -> List[str]:
        """Read the outcomes a batch started with ``progress=True`` reports (``pod-0``, ``!timeout``) until
        one is ``wanted``; those read.  AssertionError if the batch ends or ``timeout`` passes first."""
        assert self.proc.stderr is not None
        deadline = time.monotonic() + timeout
        seen: List[str] = []
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stderr], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            line = self.proc.stderr.readline().decode(errors="replace").strip()
            if not line:
                raise AssertionError(f"the batch ended before the outcome waited for; it saw {seen}")
            seen.append(line)
            if wanted(line):
                return seen
        raise AssertionError(f"not within {timeout:.0f}s: the outcome waited for; the batch saw {seen}")

    def stop(self) -> bool:
        """Start no more attempts (those in flight finish); False if the batch had already ended."""
        if self.proc.poll() is not None:
            return False
        self.proc.send_signal(signal.SIGUSR1)
        return True

    def result(self) -> ConnectResult:
        try:
            out, err = self.proc.communicate(timeout=self.budget)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise SandboxError(f"client took longer than {self.budget:.0f}s") from None
        finally:
            if self.proc.returncode is not None:
                self._on_done(self.proc)
        if self.proc.returncode != 0:
            raise SandboxError(f"client failed ({self.proc.returncode}): {err.decode(errors='replace').strip()}")
        data = json.loads(out)
        return ConnectResult(counts=data["counts"], sources=data["sources"], errors=data["errors"],
                             refusals=data.get("refusals", {}),
                             sequence=data["sequence"], elapsed=data["elapsed"],
                             first_start=data.get("first_start", 0.0), last_start=data.get("last_start", 0.0),
                             starts=data.get("starts", []))


class Session:
    """One long-lived connection (``Sandbox.open_session``): :meth:`exchange` sends a line, returns the answer."""

    def __init__(self, proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
        self.proc = proc
        self.opened = self._read()
        if "ready" not in self.opened:
            raise SandboxError(f"session did not open: {self.opened}")

    def _read(self) -> Dict[str, object]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        got: Dict[str, object] = json.loads(line) if line else {"error": "client exited"}
        return got

    def exchange(self, text: str) -> str:
        """Send ``text`` and return the pod's answer line; SandboxError naming the failure."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(text + "\n")
            self.proc.stdin.flush()
        except OSError as err:
            raise SandboxError(f"session closed: {err}") from None
        got = self._read()
        if "answer" not in got:
            raise SandboxError(f"session failed: {got.get('error')}")
        return str(got["answer"])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
