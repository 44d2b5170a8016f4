#!/usr/bin/env python3
"""The local VM runner: netproxy's kernel suite inside QEMU guests with other kernels and distros.

The node kinds come from vagrant/nodes.json (the same list the Vagrantfile reads). For each kind
this builds a Debian guest with debootstrap (cached outside the repo, rebuilt when its recipe
changes or it is missing), packs the whole root filesystem into an initramfs, and boots it with
``-accel tcg`` (this machine's /dev/kvm is a PVM hypervisor that hangs stock kernels) and no
network card. The checkout and a host-built wheelhouse are shared read-only over 9p; the guest's
/init (vagrant/local/guest-init) runs vagrant/guest-test and powers off.

    vm.py wheelhouse            build the wheelhouse for every node's Python
    vm.py build [NODE...]       build (or reuse) the guests
    vm.py run [NODE...]         build if needed, boot, test; exit non-zero on any failure
    vm.py matrix                wheelhouse + run for every node, with a summary table
    vm.py stop                  kill the QEMU processes this runner started (by pid file)

The work is split by job: vm_common.py (paths, logging, node kinds, stage timing),
vm_wheelhouse.py (the guests' dependencies, fetched on the host), vm_guest.py (building and packing
the guest images), vm_boot.py (booting one guest and reading its verdict); this file is the command
line and the matrix's summary.  Python 3.9-compatible on purpose: it is the project's floor.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import signal
import sys
from typing import Any, List

from vm_boot import Result, boot, kill_pidfile
from vm_common import CACHE, Timer, die, load_nodes, log, pick
from vm_guest import build
from vm_wheelhouse import build_wheelhouse


class Lock:
    """One runner at a time per cache: two would rebuild the same guest under each other."""

    def __enter__(self) -> None:
        CACHE.mkdir(parents=True, exist_ok=True)
        self.f = open(CACHE / "lock", "w")
        try:
            fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"another runner holds {CACHE}/lock; waiting")
            fcntl.flock(self.f, fcntl.LOCK_EX)

    def __exit__(self, *exc: Any) -> None:
        self.f.close()


def preflight() -> None:
    if os.geteuid() != 0:
        die("needs root (debootstrap, chroot)")
    for tool in ("qemu-system-x86_64", "debootstrap", "cpio", "unshare", "chroot"):
        if not shutil.which(tool):
            die(f"{tool} is missing; run scripts/setup-system.sh qemu-system-x86 debootstrap cpio")
    free = shutil.disk_usage(CACHE if CACHE.exists() else CACHE.parent).free
    if free < 4 << 30:
        die(f"less than 4 GiB free under {CACHE}; the three guests need about 3 GiB")


def print_summary(results: List[Result], timer: Timer) -> None:
    print("\n=== VM matrix ===", flush=True)
    for r in results:
        verdict = "ok" if r.ok else "FAILED"
        print(f"{r.node:14} kernel {r.kernel:24} {r.passed} passed, {r.failed} failed, {r.skipped} skipped"
              f"  boot {r.boot_s:.0f} s, total {r.total_s:.0f} s  {verdict} {r.note}")
        for c in r.combos:
            print(f"{'':16}{c}")
        if r.guest_stages:
            print(f"{'':16}in the guest: {'; '.join(r.guest_stages)}")
    print("stage wall times:")
    for s in timer.stages:
        print(f"  {s['seconds']:7.1f} s  {s['stage']}")
    (CACHE / "last-run.json").write_text(json.dumps(
        {"results": [r.__dict__ for r in results], "stages": timer.stages}, indent=2))


def cmd_run(names: List[str]) -> int:
    preflight()
    common, nodes = load_nodes()
    chosen = pick(nodes, names)
    timer = Timer()
    results: List[Result] = []
    with Lock():
        wh = build_wheelhouse(nodes, timer)  # keyed on every node, so a one-node run keeps it
        for node in chosen:
            build(node, common, wh, timer)
        # One guest after another: two cores are shared, and TCG would starve a parallel guest.
        for node in chosen:
            results.append(boot(node, wh, timer))
    print_summary(results, timer)
    total_p = sum(r.passed for r in results)
    total_f = sum(r.failed for r in results) + sum(1 for r in results if not r.ok and r.failed == 0)
    total_s = sum(r.skipped for r in results)
    print(f"{total_p} passed, {total_f} failed, {total_s} skipped", flush=True)
    return 0 if all(r.ok for r in results) else 1


def cmd_build(names: List[str]) -> int:
    preflight()
    common, nodes = load_nodes()
    timer = Timer()
    with Lock():
        wh = build_wheelhouse(nodes, timer)
        for node in pick(nodes, names):
            build(node, common, wh, timer)
    return 0


def cmd_stop() -> int:
    for pidfile in (CACHE / "run").glob("*.pid"):
        log(f"stopping {pidfile.stem}")
        kill_pidfile(pidfile)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("wheelhouse")
    for name in ("build", "run"):
        p = sub.add_parser(name)
        p.add_argument("nodes", nargs="*")
    sub.add_parser("matrix")
    sub.add_parser("stop")
    args = ap.parse_args()

    # Turn SIGTERM/SIGHUP into SystemExit so that the finally blocks kill QEMU by its pid file.
    def bail(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, bail)
    if args.cmd == "wheelhouse":
        preflight()
        _, nodes = load_nodes()
        with Lock():
            build_wheelhouse(nodes, Timer())
        return 0
    if args.cmd == "build":
        return cmd_build(args.nodes)
    if args.cmd == "run":
        return cmd_run(args.nodes)
    if args.cmd == "matrix":
        return cmd_run([])
    return cmd_stop()


if __name__ == "__main__":
    sys.exit(main())
