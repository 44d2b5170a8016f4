"""Restart by adoption, measured: what a new process's first sync costs when the kernel already holds
the tables a previous netproxy wrote (backends/nftables/adopt.py), against the full rewrite it did
before.

    sudo .venv/bin/python -m bench.adoption --services 10000 [--services 100000]

In one process, in a network namespace this script creates (``np-bench-adopt-<pid>``) and deletes
afterwards: gen.py's uniform cluster (N services x 10 endpoints) as model objects, then for each N

1. ``first``: a backend writes it into the empty namespace (a full sync);
2. ``same``: a new backend (a restarted process: no record, its own netlink socket) syncs the same
   snapshot: adoption, nothing to write;
3. ``one endpoint``: a new backend syncs it with one endpoint of one service replaced;
4. ``rewrite``: a new backend with adoption switched off syncs the same: the full rewrite every
   restart did before adoption.

Each line: CPU seconds of this process (``time.process_time``), wall seconds, and what the sync
reported (full, service ports written, bytes).  The model's construction is not timed (a restart
loads its source before the first sync either way).

``--process`` times whole ``netproxy sync --source FILE`` processes instead (gen.py's objects as a
JSON List; wall seconds, and user + system CPU seconds of the child): the first, a restart with the
same file, one with one endpoint replaced, and one with that file after the table stamp was deleted
(``nft delete element ip netproxy stamp { 1 }``: a table no stamp vouches for, rewritten whole as
every restart was before adoption).  ``--backend iptables-legacy`` (or ``iptables-nft``) does the same
for the iptables backend (backends/iptables/adopt.py); its ``rewrite`` step flushes the stamp chain
first (``iptables -t mangle -F KUBE-NP-STAMP``, both families).
"""

from __future__ import annotations

import argparse
import gc
import ipaddress
import json
import os
import subprocess
import sys
import time
from typing import Any, Dict, List


def _measure(label: str, backend: Any, snapshot: Any) -> Dict[str, Any]:
    from netproxy.core.model import Changes

    gc.collect()
    cpu, wall = time.process_time(), time.perf_counter()
    result = backend.sync(snapshot, Changes(full=True))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {"step": label, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3), "full": result.full,
            "written": result.services_written, "bytes": result.bytes_written}


def inside(sizes: List[int]) -> List[Dict[str, Any]]:
    from bench import gen
    from bench.objects import snapshot
    from netproxy.backends.nftables import NftablesBackend
    from netproxy.core.config import ProxyConfig
    from netproxy.core.model import Endpoint, Snapshot

    config = ProxyConfig(hostname=gen.LOCAL_NODE, one_shot=True)
    out = []
    for n in sizes:
        snap = snapshot(n, 10)
        name = sorted(snap.services)[n // 2]
        eps = dict(snap.endpoints)
        eps[name] = eps[name][:-1] + (Endpoint(ipaddress.ip_address("10.100.0.1"), gen.TARGET_PORT),)
        changed = Snapshot.build(list(snap.services.values()), eps, snap.node)
        rows = [_measure("first", NftablesBackend(config), snap),
                _measure("same", NftablesBackend(config), snap),
                _measure("one endpoint", NftablesBackend(config), changed)]
        old = NftablesBackend(config)
        old._adopt_pending = False  # the restart before adoption: a full rewrite
        rows.append(_measure("rewrite", old, changed))
        for r in rows:
            r["services"] = n
            print(json.dumps(r), flush=True)
        out.extend(rows)
        NftablesBackend(config).cleanup()
        del snap, changed, eps
    return out


BACKENDS = {
    "nftables": (["--backend", "nftables"], [["nft", "delete", "element", "ip", "netproxy", "stamp", "{ 1 }"]],
                 "adopted the tables"),
    "iptables-legacy": (["--backend", "iptables", "--iptables-flavour", "legacy"],
                        [[f"{t}-legacy", "-t", "mangle", "-F", "KUBE-NP-STAMP"] for t in ("iptables", "ip6tables")],
                        "tables adopted"),
    "iptables-nft": (["--backend", "iptables", "--iptables-flavour", "nft"],
                     [[f"{t}-nft", "-t", "mangle", "-F", "KUBE-NP-STAMP"] for t in ("iptables", "ip6tables")],
                     "tables adopted"),
}
"""--backend: its flags, the commands that remove its stamp (the ``rewrite`` step), what its log says
when it adopts."""


def processes(sizes: List[int], workdir: str, backend: str = "nftables") -> None:
    import resource

    from bench import gen

    flags, unstamp, adopted_log = BACKENDS[backend]

    for n in sizes:
        objects = gen.cluster(n)
        same, changed = os.path.join(workdir, f"adopt-{n}.json"), os.path.join(workdir, f"adopt-{n}-changed.json")
        gen.write_json(same, objects)
        moved = list(objects)
        moved[2 * (n // 2) + 1] = gen.replaced_endpoint(objects, n // 2, 1)
        gen.write_json(changed, moved)
        steps = [("first", same, None), ("same", same, None), ("one endpoint", changed, None),
                 ("rewrite", same, unstamp)]
        for label, path, before in steps:
            for command in before or ():
                subprocess.run(command, check=True)
            usage = resource.getrusage(resource.RUSAGE_CHILDREN)
            wall = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "netproxy", "sync", "--source", path, *flags,
                                   "--hostname-override", gen.LOCAL_NODE], capture_output=True, text=True)
            wall = time.perf_counter() - wall
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime)
            adopted = adopted_log in proc.stderr
            print(json.dumps({"step": label, "backend": backend, "services": n, "process_cpu_s": round(cpu, 3),
                              "process_wall_s": round(wall, 3), "exit": proc.returncode, "adopted": adopted}),
                  flush=True)
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr[-3000:])
        subprocess.run([sys.executable, "-m", "netproxy", "cleanup", *flags], capture_output=True)
        os.unlink(same)
        os.unlink(changed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, action="append", help="N (repeatable; default 10000)")
    parser.add_argument("--process", action="store_true", help="time whole `netproxy sync` processes")
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="nftables",
                        help="with --process: the backend whose restarts are timed")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = args.services or [10000]
    if args.inside:
        if args.process:
            processes(sizes, os.environ.get("TMPDIR", "/tmp"), args.backend)
        else:
            inside(sizes)
        return
    ns = f"np-bench-adopt-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "bench.adoption", "--inside"]
        if args.process:
            cmd += ["--process", "--backend", args.backend]
        for n in sizes:
            cmd += ["--services", str(n)]
        sys.exit(subprocess.run(cmd).returncode)
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


if __name__ == "__main__":
    main()
