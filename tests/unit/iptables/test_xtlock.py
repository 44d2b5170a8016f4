"""The xtables lock, on a private lock file (never the host's /run/xtables.lock), and reading a table
another program is writing."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

from netproxy.backends.base import SyncError
from netproxy.backends.iptables.kernel import restore
from netproxy.backends.iptables.xtlock import XtablesLock, holder, lock_path

_HOLD = "import fcntl,sys,time;f=open(sys.argv[1],'a');fcntl.flock(f,fcntl.LOCK_EX);print('held',flush=True);" \
        "time.sleep(30)"


@pytest.fixture()
def path(tmp_path: object) -> str:
    return os.path.join(str(tmp_path), "xtables.lock")


@pytest.fixture()
def held(path: str) -> Iterator[subprocess.Popen]:  # type: ignore[type-arg]
    """Another process holding the lock until the test ends."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, path], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: List[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_a_free_lock_is_taken_at_once_and_held_for_the_block(path: str) -> None:
    waits: List[float] = []
    lock = XtablesLock(5.0, path, waits=waits.append)
    # what another iptables would do meanwhile:
    with lock.hold(), open(path) as other, pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(path) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released after the block
    assert len(waits) == 1 and waits[0] < 0.5


def test_a_held_lock_times_out_with_the_lock_and_its_holder_named(path: str, held: subprocess.Popen) -> None:  # type: ignore[type-arg]
    fake = FakeTime()
    waits: List[float] = []
    lock = XtablesLock(2.0, path, waits=waits.append, clock=fake.clock, sleep=fake.sleep)
    with pytest.raises(SyncError) as err, lock.hold():
        pass
    text = str(err.value)
    assert path in text and f"pid {held.pid} (python" in text and "--iptables-lock-timeout=2s" in text
    assert waits == [pytest.approx(2.0)]  # the wait that hit the timeout is counted too
    assert all(s == pytest.approx(0.1) for s in fake.sleeps)  # kube-proxy's -W 100000


def test_wait_free_returns_what_is_left_for_the_tools_own_wait(path: str) -> None:
    fake = FakeTime()
    lock = XtablesLock(5.0, path, clock=fake.clock, sleep=fake.sleep)
    assert lock.wait_free() == pytest.approx(5.0)
    assert XtablesLock.tool_flags(4.2) == ["-w", "5", "-W", "100000"]
    assert XtablesLock.tool_flags(0.0) == ["-w", "1", "-W", "100000"]  # -w 0 would mean "don't wait"


def test_holder_is_none_when_nobody_holds_it(path: str) -> None:
    open(path, "a").close()
    assert holder(path) is None
    assert holder(path + ".missing") is None


def test_negative_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="iptables-lock-timeout"):
        XtablesLock(-1.0)


def test_lock_path_follows_xtables_lockfile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XTABLES_LOCKFILE", raising=False)
    assert lock_path() == "/run/xtables.lock"
    monkeypatch.setenv("XTABLES_LOCKFILE", "/tmp/elsewhere.lock")
    assert lock_path() == "/tmp/elsewhere.lock"


def test_restore_waits_for_the_lock_on_legacy_only(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    waits: List[float] = []
    legacy = restore.RestoreTools("legacy", XtablesLock(5.0, path, waits=waits.append))
    # The wait is ours; the tool's -w outlasts any stream (its alarm would cut the input: restore.py).
    assert legacy._wait_flags() == ["-w", "120", "-W", "100000"] and len(waits) == 1
    nft = restore.RestoreTools("nft", XtablesLock(5.0, path, waits=waits.append))
    assert nft._wait_flags() == ["-w", "5", "-W", "100000"] and len(waits) == 1  # iptables-nft: no lock


def test_a_tool_that_gave_up_on_the_lock_is_reported_like_our_own_timeout(path: str) -> None:
    tools = restore.RestoreTools("legacy", XtablesLock(5.0, path))
    stderr = "Another app is currently holding the xtables lock. Stopped waiting after 5s."
    err = tools._refused(["iptables-restore"], 4, stderr, "*nat\nCOMMIT\n")
    assert path in str(err) and "--iptables-lock-timeout=5s" in str(err)
    other = tools._refused(["iptables-restore"], 1, "line 2 failed", "*nat\n-A X\nCOMMIT\n")
    assert other.line == "-A X"


def test_the_flag_reaches_both_writers_and_defaults_to_kube_proxys_5s() -> None:
    from netproxy.backends.iptables import IptablesBackend
    from netproxy.cli.args import build_parser
    from netproxy.cli.settings import proxy_config

    args = build_parser().parse_args(["sync", "--source", "x", "--iptables-lock-timeout", "2s"])
    config = proxy_config(args, "iptables", "legacy")
    assert config.iptables_lock_timeout == 2.0
    restore_backend = IptablesBackend(config)
    assert restore_backend.kernel.tools.lock is restore_backend.lock  # type: ignore[attr-defined]
    assert restore_backend.lock.timeout == 2.0
    default = proxy_config(build_parser().parse_args(["sync", "--source", "x"]), "iptables", "legacy")
    assert default.iptables_lock_timeout == 5.0
    from netproxy.core.config import ProxyConfig

    libiptc = IptablesBackend(ProxyConfig(iptables_writer="libiptc", iptables_lock_timeout=3.0, hostname="n"))
    assert libiptc.kernel.lock is libiptc.lock and libiptc.lock.timeout == 3.0  # type: ignore[attr-defined]


class _NoSocket:
    """Stands in for the raw socket stamp._blob opens (unit tests never reach the kernel)."""

    def __init__(self, *args: object) -> None:
        return None

    def __enter__(self) -> _NoSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def fileno(self) -> int:
        return -1


def test_a_table_blob_changed_between_its_two_reads_is_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another program writing between GET_INFO and GET_ENTRIES: the kernel says EAGAIN (or hands
    back another size); the reader tries again instead of failing the sync."""
    import errno

    from netproxy.backends.iptables.kernel import stamp

    answers = [OSError(errno.EAGAIN, "changed"), 0, None]  # EAGAIN, then a short read, then a good one
    calls: List[int] = []

    def fake_getsockopt(fd: int, level: int, option: int, buf: bytearray) -> int:
        calls.append(option)
        if option == stamp.SO_GET_INFO:
            struct_size = 8
            buf[-4:] = struct_size.to_bytes(4, sys.byteorder)
            return len(buf)
        answer = answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return len(buf) if answer is None else answer

    monkeypatch.setattr(stamp.socket, "socket", _NoSocket)
    monkeypatch.setattr(stamp, "_getsockopt", fake_getsockopt)
    head, buf = stamp._blob(4, "nat")
    assert calls.count(stamp.SO_GET_ENTRIES) == 3 and len(buf) == 40 + 8
    answers[:] = [OSError(errno.EPERM, "no")]
    with pytest.raises(OSError):
        stamp._blob(4, "nat")  # any other error is not retried


def test_a_stop_ends_the_wait_for_a_held_lock_at_once(path: str, held: subprocess.Popen) -> None:  # type: ignore[type-arg]
    """SIGTERM while a sync waits for a lock another program holds: the wait gives up within one
    interval of ``stop_waiting`` (not at --iptables-lock-timeout), and so does any later wait (the
    stamp at exit); a free lock is still taken.  Without it ``netproxy run`` took the lock timeout
    twice to stop (seen in a stress of stops on iptables-legacy beside a 100k-rule writer)."""
    lock = XtablesLock(60.0, path)
    outcome: List[object] = []

    def wait() -> None:
        try:
            outcome.append(lock.wait_free())
        except SyncError as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive() and not outcome  # waiting for the holder
    start = time.monotonic()
    lock.stop_waiting()
    waiter.join(5)
    assert not waiter.is_alive(), "stop_waiting did not end the wait"
    assert time.monotonic() - start < 1.0
    assert len(outcome) == 1 and isinstance(outcome[0], SyncError) and "stopping" in str(outcome[0])
    begun = time.monotonic()
    with pytest.raises(SyncError, match="stopping"):
        lock.wait_free()  # the stamp at exit: no second wait
    assert time.monotonic() - begun < 0.5
    held.kill()
    held.wait()
    assert lock.wait_free() == pytest.approx(60.0, abs=1.0)  # free: taken as before


def test_halting_the_iptables_backend_stops_its_lock_waits(path: str, held: subprocess.Popen,  # type: ignore[type-arg]
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``Proxy.halt`` (the SIGTERM) reaches the backend's lock: what connects the stop to the wait."""
    from netproxy.backends.iptables import IptablesBackend
    from netproxy.core.config import ProxyConfig

    monkeypatch.setenv("XTABLES_LOCKFILE", path)
    backend = IptablesBackend(ProxyConfig(iptables_lock_timeout=60.0, iptables_flavour="legacy"))
    backend.halting()
    begun = time.monotonic()
    with pytest.raises(SyncError, match="stopping"):
        backend.lock.wait_free()
    assert time.monotonic() - begun < 0.5


def test_restore_stream_runs_meanwhile_once_the_payload_is_in_and_before_the_tool_is_done(
        tmp_path: Path, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``meanwhile`` (the stamp's digests) runs in the time the tool commits, in which this process
    would only wait: after the last chunk is handed over and stdin closed, before the tool exits."""
    done = os.path.join(tmp_path, "done")
    tool = os.path.join(tmp_path, "fake-restore")
    with open(tool, "w") as fh:  # reads its input to the end, then "commits" for a while
        fh.write(f"#!/bin/sh\ncat > /dev/null\nsleep 0.5\ntouch {done}\n")
    os.chmod(tool, 0o755)
    monkeypatch.setattr(restore, "tool", lambda family, flavour, verb: tool)
    seen: List[Tuple[int, bool]] = []
    made: List[str] = []

    def chunks() -> Iterator[str]:
        for piece in ("*nat\n", ":NP-X - [0:0]\n", "COMMIT\n"):
            made.append(piece)
            yield piece

    tools = restore.RestoreTools("nft", XtablesLock(5.0, path))
    sent = tools.restore_stream(4, chunks, meanwhile=lambda: seen.append((len(made), os.path.exists(done))))
    assert sent == len("*nat\n:NP-X - [0:0]\nCOMMIT\n")
    assert seen == [(3, False)], "once, after the whole payload, while the tool still ran"
    assert os.path.exists(done)
