"""Booting a guest: QEMU under TCG with the checkout and the wheelhouse shared over 9p.

``-accel tcg`` because this machine's /dev/kvm is a PVM hypervisor that hangs stock kernels; no
network card.  The guest's /init runs vagrant/guest-test and powers off; its console is streamed
and guest-test's verdict read from it.  QEMU is only ever stopped through its own pid file.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator, List, Optional

from vm_common import CACHE, REPO, Node, Timer

MEMORY_MB = int(os.environ.get("NETPROXY_VM_MEMORY", "1536"))
CPUS = int(os.environ.get("NETPROXY_VM_CPUS", "2"))
# Boot + the whole kernel suite under TCG; generous, because a hung guest is killed anyway.
TIMEOUT_S = int(os.environ.get("NETPROXY_VM_TIMEOUT", "1500"))


def kill_pidfile(pidfile: Path) -> None:
    """Stop the QEMU started with this pid file (and only it: the cmdline must name the file)."""
    try:
        pid = int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        pidfile.unlink(missing_ok=True)
        return
    if str(pidfile).encode() not in cmdline:
        pidfile.unlink(missing_ok=True)  # a stale file; that pid is someone else's now
        return
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.1)
        if not Path(f"/proc/{pid}").exists():
            break
    pidfile.unlink(missing_ok=True)


@dataclass
class Result:
    node: str
    kernel: str = "?"
    rc: Optional[int] = None
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    combos: List[str] = field(default_factory=list)
    guest_stages: List[str] = field(default_factory=list)
    boot_s: float = 0.0
    total_s: float = 0.0
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.rc == 0 and self.failed == 0 and self.passed > 0


def boot(node: Node, wh: Path, timer: Timer) -> Result:
    """Boot the guest, stream its console, and read guest-test's verdict from it."""
    d = node.dir
    rundir = CACHE / "run"
    rundir.mkdir(parents=True, exist_ok=True)
    pidfile = rundir / f"{node.name}.pid"
    kill_pidfile(pidfile)
    logfile = CACHE / "logs" / f"{node.name}.log"
    logfile.parent.mkdir(parents=True, exist_ok=True)
    full = " netproxy.full=1" if os.environ.get("NETPROXY_VM_FULL", "") == "1" else ""
    # How far the guest's waits stretch (its NETPROXY_TEST_TIME_SCALE; guest-test's default is 4 for
    # TCG alone): make test runs the guest beside the host's tests, where it gets about half a core.
    scale = os.environ.get("NETPROXY_VM_TIME_SCALE", "")
    full += f" netproxy.time_scale={scale}" if scale.replace(".", "", 1).isdigit() else ""
    append = f"console=ttyS0 panic=-1 quiet loglevel=4 netproxy.node={node.name}{full} {node.kernel_args}".strip()
    cmd = [
        "qemu-system-x86_64", "-accel", "tcg,thread=multi", "-m", str(MEMORY_MB), "-smp", str(CPUS),
        "-nodefaults", "-no-reboot", "-display", "none", "-monitor", "none", "-serial", "stdio",
        "-nic", "none",  # no network card: the guest talks only between its own namespaces
        "-kernel", str(d / "vmlinuz"), "-initrd", str(d / "rootfs.cpio"), "-append", append,
        "-virtfs", f"local,path={REPO},mount_tag=src,security_model=none,readonly=on,id=src",
        "-virtfs", f"local,path={wh},mount_tag=wheels,security_model=none,readonly=on,id=wheels",
        "-pidfile", str(pidfile),
    ]
    res = Result(node=node.name)
    t0 = time.monotonic()
    timed_out = threading.Event()
    with timer.stage(f"{node.name}: boot + test + power-off"), open(logfile, "w") as lf:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

        def hung() -> None:  # the guest did not power off in time: stop QEMU by its pid file
            timed_out.set()
            kill_pidfile(pidfile)
            proc.kill()

        watchdog = threading.Timer(TIMEOUT_S, hung)
        watchdog.start()
        try:
            assert proc.stdout is not None
            for raw in _lines(proc.stdout):
                line = raw.decode(errors="replace").rstrip("\r\n")
                lf.write(line + "\n")
                print(f"  [{node.name}] {line}", flush=True)
                if line.startswith("netproxy-guest-start") and not res.boot_s:
                    res.boot_s = round(time.monotonic() - t0, 1)
                m = re.match(r"netproxy-kernel: (\S+)", line)
                if m:
                    res.kernel = m.group(1)
                m = re.match(r"netproxy-combo: (.*)", line)
                if m:
                    res.combos.append(m.group(1))
                m = re.match(r"netproxy-stage: (.*)", line)
                if m:
                    res.guest_stages.append(m.group(1))
                m = re.match(r"^(?:\w+: )?(\d+) passed, (\d+) failed(?:, (\d+) skipped)?$", line)
                if m:
                    res.passed, res.failed, res.skipped = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
                m = re.match(r"netproxy-guest-exit: (\d+)", line)
                if m:
                    res.rc = int(m.group(1))
            proc.wait()
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                kill_pidfile(pidfile)
                proc.kill()
                proc.wait()
            pidfile.unlink(missing_ok=True)
    res.total_s = round(time.monotonic() - t0, 1)
    if timed_out.is_set():
        res.note = f"timed out after {TIMEOUT_S} s"
    elif res.rc is None:
        res.note = f"guest died before reporting (QEMU exit {proc.returncode}); see {logfile}"
    return res


def _lines(stream: IO[bytes]) -> Iterator[bytes]:
    yield from iter(stream.readline, b"")
