"""The restore writer: ``iptables-save`` to read, one ``iptables-restore --noflush --counters -w S -W U`` to write.

The payload for one family covers every table that changes; each table's block applies atomically
(the legacy kernel API swaps whole tables), so a refused line leaves that table as it was.
"""

from __future__ import annotations

import collections
import errno
import logging
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from typing import AbstractSet, Callable, Deque, Dict, Iterable, List, Optional, Sequence

from netproxy.backends.base import BackendUnavailable, SyncError
from netproxy.backends.iptables import save
from netproxy.backends.iptables.assemble import TABLES
from netproxy.backends.iptables.diff import KernelTable, TableChange
from netproxy.backends.iptables.kernel import Counts, blob_counts, legacy_header, saved_counts
from netproxy.backends.iptables.kernel.stamp import Expected, Stamp, fingerprint, generation_stamp, read_table
from netproxy.backends.iptables.payload import ChainTextCache, restore_chunks
from netproxy.backends.iptables.xtlock import EXIT_RESOURCE, XtablesLock, timeout_error

log = logging.getLogger(__name__)

_LINE_FAILED = re.compile(r"line:?\s+(\d+)(?:\s+failed)?", re.IGNORECASE)
TIMEOUT = 120.0


def tool(family: int, flavour: str, verb: str) -> str:
    """``iptables-legacy-restore`` and friends; plain ``iptables-restore`` when the flavoured one is
    missing (older distributions ship only the plain name, which is then legacy)."""
    base = "iptables" if family == 4 else "ip6tables"
    for candidate in (f"{base}-{flavour}-{verb}", f"{base}-{verb}"):
        path = shutil.which(candidate) or shutil.which(candidate, path="/usr/sbin:/sbin:/usr/local/sbin")
        if path:
            return path
    raise BackendUnavailable(f"neither {base}-{flavour}-{verb} nor {base}-{verb} is installed")


def failing_line(stderr: str, payload: str) -> Optional[str]:
    """The payload line iptables-restore named in its error ("line 7 failed", "Error occurred at line: 7")."""
    match = _LINE_FAILED.search(stderr)
    if not match:
        return None
    lines = payload.splitlines()
    index = int(match.group(1)) - 1
    return lines[index] if 0 <= index < len(lines) else None


_VERSION = re.compile(r"v(\d+)\.(\d+)\.(\d+)")
RANDOM_FULLY_SINCE = (1, 6, 2)
"""iptables learnt MASQUERADE --random-fully in 1.6.2 (the kernel in 3.13, older than any we run on)."""


def supports_random_fully(flavour: str) -> bool:
    """Whether this node's iptables takes ``--random-fully``, from ``iptables-<flavour> --version``
    (no kernel access).  A version we cannot read counts as new enough: every supported distribution
    ships >= 1.6.2, and a wrong guess is refused by the restore with the line named, not silently."""
    for name in (f"iptables-{flavour}", "iptables"):
        path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/local/sbin")
        if not path:
            continue
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.SubprocessError):
            return True
        found = _VERSION.search(out.stdout + out.stderr)
        if found:
            return tuple(int(x) for x in found.groups()) >= RANDOM_FULLY_SINCE
        return True
    return True


def _run(cmd: List[str], payload: Optional[str] = None) -> subprocess.CompletedProcess[str]:
    """Run a save/restore tool; a stuck tool (e.g. waiting on another writer's xtables lock) or a
    missing one is a SyncError like any refused write, so the proxy retries instead of dying."""
    try:
        return subprocess.run(cmd, input=payload, capture_output=True, text=True, timeout=TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        raise SyncError(f"{cmd[0]} did not finish within {TIMEOUT:.0f} s (xtables lock held by another writer?)",
                        payload=payload) from None
    except OSError as err:
        raise SyncError(f"cannot run {cmd[0]}: {err.strerror}", payload=payload) from None


LOCK_TIMEOUT = 5.0
"""kube-proxy's iptables-restore ``-w 5``: the default of ``--iptables-lock-timeout``."""
STREAM_WAIT = TIMEOUT
"""iptables-legacy-restore's ``-w``: as long as the tool may run at all (see ``_wait_flags``)."""


class RestoreTools:
    """The save/restore binaries for one iptables flavour ("legacy" or "nft")."""

    def __init__(self, flavour: str, lock: Optional[XtablesLock] = None) -> None:
        self.flavour = flavour
        self.lock = lock if lock is not None else XtablesLock(LOCK_TIMEOUT)
        self.children: Deque[int] = collections.deque(maxlen=32)
        """Pids of the latest restore processes: their nf_tables commits are ours (``guard.NftWatch``)."""

    def _wait_flags(self) -> List[str]:
        """``-w <secs> -W <usecs>`` for iptables-restore.  On legacy tables the lock is waited for here
        first (``--iptables-lock-timeout``, and the wait is measured: the tool does not say how long
        it waited); the tool then gets :data:`STREAM_WAIT`, not what is left of the timeout, because
        iptables-legacy-restore (1.8.9 here) arms ``alarm(<-w>)`` to bound its own lock wait and never
        disarms it: the SIGALRM later interrupts its read of stdin, which it takes for the end of the
        input ("COMMIT expected at line N").  A payload streamed for longer than ``-w`` seconds then
        fails whenever the tool is waiting for the next chunk at that moment: a restart at 100k
        services did (bench --scale 100000), and ``(echo '*filter'; sleep 3; echo COMMIT) |
        iptables-legacy-restore -w 1`` does (tests/kernel/test_restore_stream.py).  What this costs:
        only if another program takes the lock in the moment between our wait and the tool's may
        the tool wait longer than the timeout, up to STREAM_WAIT.  iptables-nft takes no lock and
        ignores the flags."""
        if self.flavour != "legacy":
            return self.lock.tool_flags(self.lock.timeout)
        self.lock.wait_free()
        return self.lock.tool_flags(STREAM_WAIT)

    def _refused(self, cmd: List[str], code: int, stderr: str, payload: str) -> SyncError:
        if code == EXIT_RESOURCE and self.lock.gave_up(stderr):
            # Taken again by someone else between our wait and the tool's: the same error as ours.
            return timeout_error(self.lock.path, self.lock.timeout)
        line = failing_line(stderr, payload)
        log.error("%s failed: %s; failing line: %s", cmd[0], stderr, line)
        return SyncError(f"{cmd[0]} refused the payload", line=line, detail=stderr, payload=payload)

    def probe(self) -> None:
        for verb in ("save", "restore"):
            tool(4, self.flavour, verb)

    def save(self, family: int, table: str) -> str:
        cmd = [tool(family, self.flavour, "save"), "-t", table]
        proc = _run(cmd)
        if proc.returncode != 0:
            raise SyncError(f"{' '.join(cmd)} failed", detail=proc.stderr.strip())
        return proc.stdout

    def restore_stream(self, family: int, chunks: Callable[[], Iterable[str]],
                       before_commit: Optional[Callable[[], None]] = None,
                       meanwhile: Optional[Callable[[], None]] = None) -> int:
        """Feed ``iptables-restore`` piece by piece as the pieces are made, so that it parses while we
        write (two cores: Python's text and the tool's parsing overlap).  All or nothing still: the
        tool commits each table at its COMMIT line.  ``chunks()`` makes the pieces; it is called a
        second time only to name the failing line of a refused payload (the text is not kept: 50 MB
        at the mixed 10k cluster).  ``meanwhile`` runs once the tool has all of it, while it commits
        (the kernel checks and swaps each table: ~0.3 s at 10k services, in which this process
        would only wait).  Returns the bytes written."""
        cmd = [tool(family, self.flavour, "restore"), "--noflush", "--counters", *self._wait_flags()]
        sent = 0
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err)
            self.children.append(proc.pid)
            assert proc.stdin is not None
            try:
                for chunk in chunks():
                    if before_commit is not None and "COMMIT\n" in chunk:
                        before_commit()  # the tool commits at that line: what must precede it, now
                        before_commit = None
                    data = chunk.encode()
                    sent += len(data)
                    proc.stdin.write(data)
                proc.stdin.close()
                if meanwhile is not None:
                    meanwhile()
            except BrokenPipeError:
                pass  # the tool stopped at a bad line; its exit status and stderr say which
            except BaseException:
                proc.kill()
                proc.wait()
                raise
            # A timer kills a stuck tool; Popen.wait(timeout=...) would poll with sleeps of up to
            # 50 ms (measured: +80 ms on every partial sync at 1k services).
            timer = threading.Timer(TIMEOUT, proc.kill)
            timer.start()
            try:
                code = proc.wait()
            finally:
                timer.cancel()
            if code == -signal.SIGKILL:
                raise SyncError(f"{cmd[0]} was killed (timeout {TIMEOUT:.0f} s)")
            err.seek(0)
            stderr = err.read().decode(errors="replace").strip()
        if code != 0:
            raise self._refused(cmd, code, stderr, "".join(chunks()))
        return sent

    def restore(self, family: int, payload: str, extra: Sequence[str] = ()) -> None:
        cmd = [tool(family, self.flavour, "restore"), "--noflush", "--counters", *self._wait_flags(), *extra]
        proc = _run(cmd, payload)
        if proc.returncode != 0:
            raise self._refused(cmd, proc.returncode, proc.stderr.strip(), payload)


class RestoreWriter:
    """The default writer."""

    name = "restore"

    def __init__(self, flavour: str, keep_text: bool = True, lock: Optional[XtablesLock] = None) -> None:
        self.tools = RestoreTools(flavour, lock)
        self._texts: Dict[int, ChainTextCache] = {}
        self._keep_text = keep_text
        """Keep each chain's text for the next write (a long-running proxy); not for one sync."""
        self._blob: Optional[bool] = None
        """Whether reading the kernel's table blob works here (None: not tried yet)."""

    def probe(self) -> None:
        self.tools.probe()

    def read(self, family: int, fingerprint: bool = False) -> Dict[str, KernelTable]:
        """Chain names and built-in jumps (the libiptc writer reads them the same way).  On legacy
        nodes from the kernel's table blob (one
        ``getsockopt`` per table, walked in Python: ``stamp.chains_and_jumps``) instead of
        ``iptables-save`` printing 100k+ rules we do not need (2.1 s → 0.27 s at 10k services; also
        0.5 s and 50 MB less than reading through python-iptables).  Otherwise ``iptables-save``."""
        if self.tools.flavour == "legacy" and self._blob is not False:
            try:
                tables: Dict[str, KernelTable] = {}
                for table in TABLES:
                    got = read_table(family, table, fingerprint)
                    tables[table] = KernelTable(frozenset(got.names), frozenset(got.jumps), got.fingerprint,
                                                got.header)
                self._blob = True
                return tables
            except (OSError, ValueError) as exc:
                if isinstance(exc, OSError) and exc.errno == errno.ENOENT and family == 6:
                    raise BackendUnavailable("no IPv6 legacy tables here", detail=str(exc)) from exc
                # Only a shortcut: any trouble with it (a kernel without legacy tables behind a
                # "legacy" name, an entry it cannot walk) falls back to iptables-save for good.
                log.info("reading tables with iptables-save: %s", exc)
                self._blob = False
        return self._read_saved(family)

    def _read_saved(self, family: int) -> Dict[str, KernelTable]:
        out: Dict[str, KernelTable] = {}
        for table in TABLES:
            parsed = save.parse(self.tools.save(family, table))
            out[table] = parsed[table].kernel_table() if table in parsed else KernelTable()
        return out

    def stamp(self, families: Sequence[int], expect: Optional[Expected] = None) -> Optional[Stamp]:
        # Legacy tables by their fingerprint; iptables-nft's live in nf_tables: its generation.
        return fingerprint(families, TABLES, expect) if self.tools.flavour == "legacy" else generation_stamp()

    def header(self, family: int, table: str) -> Optional[bytes]:
        return legacy_header(family, table) if self.tools.flavour == "legacy" else None

    def counts(self, family: int, table: str) -> Counts:
        if self.tools.flavour == "legacy":
            return blob_counts(family, table)
        return saved_counts(self.tools, family, table)

    def own_pids(self) -> AbstractSet[int]:
        return set(self.tools.children)

    def save(self, family: int, table: str) -> str:
        return self.tools.save(family, table)

    def restore(self, family: int, payload: str) -> None:
        self.tools.restore(family, payload)

    def apply(self, family: int, changes: List[TableChange],
              before_commit: Optional[Callable[[], None]] = None,
              meanwhile: Optional[Callable[[], None]] = None) -> int:
        if not any(not c.empty() for c in changes):
            if meanwhile is not None:
                meanwhile()
            return 0
        cache = self._texts.setdefault(family, ChainTextCache()) if self._keep_text else None
        return self.tools.restore_stream(family, lambda: restore_chunks(changes, cache), before_commit, meanwhile)
