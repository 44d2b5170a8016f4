"""Guest images: a Debian root filesystem per node kind, built with debootstrap, packed as an initramfs.

Cached under the runner's cache and rebuilt when its recipe changes or it is missing: the base
(debootstrap minbase + kernel + packages, slimmed), the project's dependencies from the wheelhouse
in the guest's venv (installed in a chroot, at native speed), and the whole tree as one
uncompressed cpio with vagrant/local/guest-init as its /init.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

from vm_common import CACHE, HERE, Node, Timer, die, log, run, sha
from vm_wheelhouse import host_pip, target_args

GUEST_INIT = HERE / "guest-init"
MIRROR = os.environ.get("NETPROXY_VM_MIRROR", "http://deb.debian.org/debian")
VENV_IN_GUEST = "/opt/netproxy-venv"

# Bump when the recipe below changes in a way that needs a fresh debootstrap.
BASE_RECIPE = "3"

# Kernel modules kept in the guest. A Debian kernel ships ~4000 modules (hundreds of MB); the
# guest runs from RAM, so everything but networking, netfilter, 9p and virtio goes.
KEEP_MODULE_DIRS = (
    "kernel/net/",
    "kernel/lib/",
    "kernel/crypto/",
    "kernel/arch/",
    "kernel/fs/9p/",
    "kernel/fs/netfs/",
    "kernel/fs/fscache/",
    "kernel/drivers/virtio/",
)

CLEAN_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "DEBIAN_FRONTEND": "noninteractive",
}


def chroot_env() -> Dict[str, str]:
    return dict(CLEAN_ENV)


def in_chroot(root: Path, script: str, binds: Optional[Dict[str, Path]] = None,
              check: bool = True) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    """Run a shell script inside the guest tree, in a private mount namespace.

    unshare --mount makes /proc, /dev and bind mounts vanish with the process, so an interrupted
    build leaves no mounts behind on the host. With check=False the output is captured and
    returned instead of failing.
    """
    mounts = [
        f"mount -t proc proc {root}/proc",
        f"mount --rbind /dev {root}/dev",  # with /dev/pts, which apt wants
        f"mount -t tmpfs tmpfs {root}/tmp",
    ]
    for guest_path, host_path in (binds or {}).items():
        mounts.append(f"mkdir -p {root}{guest_path} && mount --bind -o ro {host_path} {root}{guest_path}")
    outer = "set -e; mount --make-rprivate /; " + "; ".join(mounts) + f"; exec chroot {root} /bin/sh -ec \"$1\""
    cmd = ["unshare", "--mount", "--fork", "sh", "-c", outer, "sh", script]
    if check:
        return run(cmd, env=chroot_env())
    return subprocess.run(cmd, env=chroot_env(), capture_output=True, text=True)


def base_key(node: Node, common: List[str]) -> str:
    return sha(BASE_RECIPE, node.suite, node.iptables, MIRROR, json.dumps(sorted(set(common + node.packages))))


def build_base(node: Node, common: List[str], timer: Timer) -> Path:
    """debootstrap the guest (minbase + kernel + our packages), slim it down; cached by recipe."""
    d = node.dir
    d.mkdir(parents=True, exist_ok=True)
    key = base_key(node, common)
    stamp = d / "base.stamp"
    root = d / "rootfs"
    if stamp.exists() and stamp.read_text() == key and root.is_dir() and (d / "vmlinuz").exists():
        log(f"{node.name}: base guest up to date ({root})")
        return root
    with timer.stage(f"{node.name}: build guest ({node.suite})"):
        tmp = d / "rootfs.new"
        if tmp.exists():
            shutil.rmtree(tmp)
        stamp.unlink(missing_ok=True)
        pkgs = sorted(set(common + node.packages))
        log(f"{node.name}: debootstrap {node.suite} ({len(pkgs)} packages + kernel)")
        debs = CACHE / "debs" / node.suite  # kept: a rebuild then downloads nothing
        debs.mkdir(parents=True, exist_ok=True)
        run(["debootstrap", "--variant=minbase", f"--cache-dir={debs}", "--include=" + ",".join(pkgs),
             node.suite, str(tmp), MIRROR], env=chroot_env(), stdout=subprocess.DEVNULL)
        # The kernel in a second step, with update-initramfs diverted to true: the guest boots from
        # our own whole-rootfs initramfs, and Debian's would cost half a minute per build.
        alt = ""
        if node.iptables == "legacy":
            alt = ("update-alternatives --set iptables /usr/sbin/iptables-legacy\n"
                   "update-alternatives --set ip6tables /usr/sbin/ip6tables-legacy\n")
        in_chroot(tmp, f"""
dpkg-divert --local --rename --add /usr/sbin/update-initramfs
ln -sf /bin/true /usr/sbin/update-initramfs
apt-get install -y -q --no-install-recommends linux-image-amd64 >/dev/null
{alt}
""")
        kvers = sorted(p.name for p in (tmp / "lib/modules").iterdir())
        if len(kvers) != 1:
            die(f"{node.name}: expected one kernel in the guest, found {kvers}")
        kver = kvers[0]
        shutil.copy(tmp / "boot" / f"vmlinuz-{kver}", d / "vmlinuz.new")
        slim(tmp, kver)
        # depmod inside the guest tree: the host has none, and module lists must match the pruning.
        in_chroot(tmp, f"depmod -a {kver}")
        (tmp / "etc/hostname").write_text(f"netproxy-{node.name}\n")
        if root.exists():
            shutil.rmtree(root)
        tmp.rename(root)
        (d / "vmlinuz.new").rename(d / "vmlinuz")
        (d / "kernel-version").write_text(kver + "\n")
        (d / "deps.stamp").unlink(missing_ok=True)
        stamp.write_text(key)
    return root


def slim(root: Path, kver: str) -> None:
    """Drop what a RAM-resident test guest never uses: most modules, docs, apt lists, /boot."""
    moddir = root / "lib/modules" / kver
    for ko in list(moddir.rglob("*.ko*")):
        rel = ko.relative_to(moddir).as_posix()
        keep = rel.startswith(KEEP_MODULE_DIRS) or re.match(r"kernel/drivers/net/[^/]+\.ko", rel)
        if not keep:
            ko.unlink()
    for sub in ("usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale", "var/cache/apt",
                "var/lib/apt/lists", "boot", "usr/lib/firmware", "lib/firmware"):
        p = root / sub
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
            p.mkdir()


def install_deps(node: Node, root: Path, wh: Path, timer: Timer) -> None:
    """Install the project's dependencies from the wheelhouse into the guest's venv.

    Done in the chroot at native speed: pip under TCG costs far more. The guest's own pip does
    the resolving, because the host's pip evaluates environment markers (python_version < "3.11"
    and the like) for the host's Python even with --python-version: whatever it then reports
    missing is fetched on the host for the guest's Python and the install is retried. The result
    is frozen into the wheelhouse as <tag>.lock. The guest still gets the wheelhouse over 9p and
    installs netproxy itself from it at every boot.
    """
    reqs = (wh / f"{node.pytag}.requirements").read_text() + (wh / f"{node.pytag}.constraints").read_text()
    key = sha(reqs, (wh / f"{node.pytag}.lock").read_text() if (wh / f"{node.pytag}.lock").exists() else "")
    stamp = node.dir / "deps.stamp"
    if stamp.exists() and stamp.read_text() == key:
        log(f"{node.name}: guest dependencies up to date")
        return
    with timer.stage(f"{node.name}: install dependencies into guest"):
        script = f"""
rm -rf {VENV_IN_GUEST}
python3 -m venv {VENV_IN_GUEST}
{VENV_IN_GUEST}/bin/pip install -q --disable-pip-version-check --no-index --find-links /mnt/wheels \\
    -r /mnt/wheels/{node.pytag}.requirements -c /mnt/wheels/{node.pytag}.constraints
{VENV_IN_GUEST}/bin/pip freeze --exclude-editable --disable-pip-version-check >/tmp/freeze
cat /tmp/freeze
"""
        fetched: List[str] = []
        while True:
            res = in_chroot(root, script, binds={"/mnt/wheels": wh}, check=False)
            if res.returncode == 0:
                break
            m = re.search(r"No matching distribution found for ([A-Za-z0-9_.\-]+)", res.stderr)
            if not m or m.group(1) in fetched:
                die(f"{node.name}: installing the dependencies in the guest failed:\n{res.stdout}{res.stderr}")
            fetched.append(m.group(1))
            log(f"{node.name}: the guest's pip also needs {m.group(1)}; fetching it for {node.pytag}")
            run(host_pip() + ["download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(wh)]
                + target_args(node.python, node.pytag, node.glibc) + [m.group(1)], stdout=subprocess.DEVNULL)
        lock = sorted(line for line in res.stdout.splitlines() if "==" in line)
        (wh / f"{node.pytag}.lock").write_text("\n".join(lock) + "\n")
        stamp.write_text(sha(reqs, (wh / f"{node.pytag}.lock").read_text()))


def pack(node: Node, root: Path, timer: Timer) -> Path:
    """The whole root filesystem as one uncompressed newc cpio: the kernel unpacks it into RAM
    (no decompression under TCG, no block device, no root= to find)."""
    out = node.dir / "rootfs.cpio"
    key = sha((node.dir / "base.stamp").read_text(), (node.dir / "deps.stamp").read_text(), GUEST_INIT.read_text())
    stamp = node.dir / "pack.stamp"
    if stamp.exists() and stamp.read_text() == key and out.exists():
        return out
    with timer.stage(f"{node.name}: pack initramfs"):
        shutil.copy(GUEST_INIT, root / "init")
        os.chmod(root / "init", 0o755)
        tmp = out.with_suffix(".new")
        with open(tmp, "wb") as f:
            find = subprocess.Popen(["find", ".", "-mindepth", "1"], cwd=root, stdout=subprocess.PIPE)
            run(["cpio", "--quiet", "-o", "-H", "newc"], cwd=root, stdin=find.stdout, stdout=f)
            if find.wait() != 0:
                die("find failed while packing the guest")
        tmp.rename(out)
        stamp.write_text(key)
        log(f"{node.name}: initramfs {out.stat().st_size // (1 << 20)} MiB")
    return out


def build(node: Node, common: List[str], wh: Path, timer: Timer) -> None:
    root = build_base(node, common, timer)
    install_deps(node, root, wh, timer)
    pack(node, root, timer)
