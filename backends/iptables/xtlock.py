"""The xtables lock: the ``flock`` on ``/run/xtables.lock`` every legacy iptables program takes around
its read-modify-commit of a table.

Legacy tables are replaced whole: a writer copies the table, changes its copy and hands the copy
back.  Two writers that do this at the same time lose one's changes, so iptables (``-w``),
iptables-restore (``-w``), firewalld and Docker all serialise on this lock.  The restore writer
passes kube-proxy's ``-w <secs> -W 100000`` to iptables-restore; the libiptc writer has no tool to do
it and holds the lock itself from its copy to its commit (:meth:`XtablesLock.hold`).

``XTABLES_LOCKFILE`` moves the lock as it moves iptables' own (iptables >= 1.8.4).  The nf_tables
flavour of iptables takes no lock (its kernel transactions are per rule), so neither does netproxy
there.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import threading
import time
from typing import Callable, Iterator, List, Optional

from netproxy.backends.base import SyncError

DEFAULT_PATH = "/run/xtables.lock"
INTERVAL = 0.1
"""Seconds between two tries: kube-proxy's ``-W 100000`` (µs)."""
EXIT_RESOURCE = 4
"""iptables' exit status when it gave up waiting for the lock (RESOURCE_PROBLEM)."""
BUSY_TEXT = "holding the xtables lock"
"""What iptables prints when it gave up waiting ("Another app is currently holding the xtables lock")."""


def lock_path() -> str:
    return os.environ.get("XTABLES_LOCKFILE") or DEFAULT_PATH


def holder(path: str) -> Optional[str]:
    """``pid N (comm)`` of a process holding a ``flock`` on ``path``, from ``/proc/locks``; None
    when nobody does or it cannot be told (a holder in another PID namespace shows no usable pid)."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        # "1: FLOCK  ADVISORY  WRITE 1234 00:1a:5678 0 EOF" (a blocked waiter's line has "->")
        fields = line.split()
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":
            continue
        dev_ino = fields[5].split(":")
        if len(dev_ino) != 3:
            continue
        try:
            major, minor, ino = int(dev_ino[0], 16), int(dev_ino[1], 16), int(dev_ino[2])
            pid = int(fields[4])
        except ValueError:
            continue
        if ino == st.st_ino and os.makedev(major, minor) == st.st_dev and pid > 0:
            return f"pid {pid} ({_comm(pid)})"
    return None


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip() or "?"
    except OSError:
        return "?"


def timeout_error(path: str, timeout: float, who: Optional[str] = None) -> SyncError:
    """The lock stayed held past ``--iptables-lock-timeout``: the write was not attempted."""
    who = who if who is not None else holder(path)
    return SyncError(f"the xtables lock {path} is held by {who or 'another program'} and was not released "
                       f"within --iptables-lock-timeout={timeout:g}s; nothing was written, retrying")


class XtablesLock:
    """Wait for (or hold) the xtables lock, bounded by ``timeout`` seconds; ``waits`` gets every wait
    in seconds (the ``netproxy_iptables_lock_wait_seconds`` histogram)."""

    def __init__(self, timeout: float, path: Optional[str] = None,
                 waits: Optional[Callable[[float], None]] = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        if timeout < 0:
            raise ValueError(f"--iptables-lock-timeout must be >= 0, not {timeout}")
        self.timeout = timeout
        self.path = path or lock_path()
        self.waits = waits
        self.clock, self.sleep = clock, sleep
        self.waited: List[float] = []
        """Every wait so far (for tests and the sync's log)."""
        self._stopping = threading.Event()

    def stop_waiting(self) -> None:
        """``netproxy run`` is stopping: from now on a lock held by someone else fails the write at
        once instead of being waited for.  Called from another thread than the waiting one.  Without
        it a SIGTERM that came while a sync waited for a busy lock was answered only when the lock
        was free or ``--iptables-lock-timeout`` ran out, and the stamp written at exit waited again:
        two timeouts before exiting (the lab's 60 s made a stop take over 10 s)."""
        self._stopping.set()

    def _acquire(self) -> int:
        """Open the lock file and take it; the fd.  Raises :func:`timeout_error`'s error past the timeout."""
        try:
            # O_CREAT like iptables: the file may not exist on a node where no iptables ran yet.
            fd = os.open(self.path, os.O_CREAT | os.O_RDONLY | os.O_CLOEXEC, 0o600)
        except OSError as err:
            raise SyncError(f"cannot open the xtables lock {self.path}: {err.strerror}") from None
        start = self.clock()
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if self._stopping.is_set():
                        self._record(self.clock() - start)
                        raise SyncError(f"netproxy is stopping: the xtables lock {self.path} is held by "
                                        f"{holder(self.path) or 'another program'}; nothing was written") from None
                    if self.clock() - start >= self.timeout:
                        self._record(self.clock() - start)
                        raise timeout_error(self.path, self.timeout) from None
                    self.sleep(INTERVAL)
        except BaseException:
            os.close(fd)
            raise
        self._record(self.clock() - start)
        return fd

    def _record(self, seconds: float) -> None:
        self.waited.append(seconds)
        del self.waited[:-100]
        if self.waits is not None:
            self.waits(seconds)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Hold the lock for the block (the libiptc writer: from its table copy to its commit)."""
        fd = self._acquire()
        try:
            yield
        finally:
            os.close(fd)  # closing the only descriptor releases the flock

    def wait_free(self) -> float:
        """Wait until the lock is free (taking and at once releasing it): the restore writer's wait,
        measured before iptables-restore is started.  Returns the seconds left of the timeout, for
        the tool's own ``-w`` (another program may take the lock again in between)."""
        start = self.clock()
        fd = self._acquire()
        os.close(fd)
        return max(0.0, self.timeout - (self.clock() - start))

    @staticmethod
    def tool_flags(left: float) -> List[str]:
        """iptables-restore's ``-w <secs> -W <usecs>`` for ``left`` seconds (whole seconds, at least 1:
        ``-w 0`` would mean "do not wait")."""
        return ["-w", str(max(1, math.ceil(left))), "-W", str(int(INTERVAL * 1_000_000))]

    def gave_up(self, stderr: str) -> bool:
        """Whether an iptables tool's error says it stopped waiting for this lock."""
        return BUSY_TEXT in stderr
