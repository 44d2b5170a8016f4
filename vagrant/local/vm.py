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

Python 3.9-compatible on purpose: it is the project's floor.
"""

from __future__ import annotations

import argparse
import email.parser
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Dict, Iterator, List, NoReturn, Optional

HERE = Path(__file__).resolve().parent
VAGRANT = HERE.parent
REPO = VAGRANT.parent
NODES_FILE = VAGRANT / "nodes.json"
GUEST_INIT = HERE / "guest-init"

CACHE = Path(os.environ.get("NETPROXY_VM_CACHE", "/var/cache/netproxy-vm"))
MIRROR = os.environ.get("NETPROXY_VM_MIRROR", "http://deb.debian.org/debian")
MEMORY_MB = int(os.environ.get("NETPROXY_VM_MEMORY", "1536"))
CPUS = int(os.environ.get("NETPROXY_VM_CPUS", "2"))
# Boot + the whole kernel suite under TCG; generous, because a hung guest is killed anyway.
TIMEOUT_S = int(os.environ.get("NETPROXY_VM_TIMEOUT", "1500"))
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


def log(msg: str) -> None:
    print(f"vm: {msg}", flush=True)


def die(msg: str) -> NoReturn:
    print(f"vm: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def run(cmd: List[str], **kw: Any) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    """Run a command, failing loudly with the command line on error."""
    try:
        return subprocess.run(cmd, check=True, **kw)
    except subprocess.CalledProcessError as e:
        die(f"command failed ({e.returncode}): {' '.join(cmd)}")
    except FileNotFoundError:
        die(f"command not found: {cmd[0]} (run scripts/setup-system.sh qemu-system-x86 debootstrap cpio)")


def sha(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


class Timer:
    """Wall time of each stage, printed at the end and kept in last-run.json."""

    def __init__(self) -> None:
        self.stages: List[Dict[str, Any]] = []

    def stage(self, name: str) -> _Stage:
        return _Stage(self, name)


class _Stage:
    def __init__(self, timer: Timer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        self.t0 = time.monotonic()

    def __exit__(self, *exc: Any) -> None:
        dt = time.monotonic() - self.t0
        self.timer.stages.append({"stage": self.name, "seconds": round(dt, 1)})
        log(f"{self.name}: {dt:.1f} s")


# ---------------------------------------------------------------------------------------------
# Node kinds


@dataclass
class Node:
    name: str
    suite: str
    kernel: str
    python: str
    glibc: str
    iptables: str
    kernel_args: str
    packages: List[str]
    expect_detect: str
    backends: List[str]
    raw: Dict[str, Any] = field(repr=False)

    @property
    def pytag(self) -> str:
        return "cp" + self.python.replace(".", "")

    @property
    def dir(self) -> Path:
        return CACHE / "guests" / self.name


def load_nodes() -> tuple[List[str], List[Node]]:
    data = json.loads(NODES_FILE.read_text())
    nodes = []
    for n in data["nodes"]:
        nodes.append(
            Node(
                name=n["name"], suite=n["suite"], kernel=n["kernel"], python=n["python"], glibc=n["glibc"],
                iptables=n["iptables"], kernel_args=n.get("kernel_args", ""), packages=n.get("packages", []),
                expect_detect=n["expect_detect"], backends=n["backends"], raw=n,
            )
        )
    return data["common_packages"], nodes


def pick(nodes: List[Node], names: List[str]) -> List[Node]:
    if not names:
        return nodes
    known = {n.name: n for n in nodes}
    for name in names:
        if name not in known:
            die(f"unknown node {name!r}; nodes.json has {', '.join(known)}")
    return [known[name] for name in names]


# ---------------------------------------------------------------------------------------------
# Wheelhouse: the project's dependencies for each guest's Python, fetched on the host


def host_pip() -> List[str]:
    return [sys.executable, "-m", "pip"]


def project_wheel(dest: Path) -> Path:
    """Build the checkout's own wheel (pure Python) into dest, replacing older ones."""
    for old in dest.glob("netproxy-*.whl"):
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        # Build from a copy: building in the checkout would leave build/ and egg-info behind in
        # other people's working tree.
        src = Path(tmp) / "src"
        shutil.copytree(
            REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache")
        )
        res = subprocess.run(host_pip() + ["wheel", "-q", "--no-deps", "-w", str(dest), str(src)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            die(f"building the netproxy wheel failed:\n{res.stdout}{res.stderr}")
    wheels = sorted(dest.glob("netproxy-*.whl"))
    if len(wheels) != 1:
        die(f"expected one netproxy wheel in {dest}, found {wheels}")
    return wheels[0]


def requirements(wheel: Path) -> List[str]:
    """The project's runtime requirements plus pytest, read from the wheel's metadata."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(name).decode())
    reqs = []
    for r in meta.get_all("Requires-Dist") or []:
        if "extra ==" not in r or re.match(r"pytest\b", r):
            reqs.append(r.split(";")[0].strip())
    return reqs


def platforms(glibc: str) -> List[str]:
    """pip --platform does not expand manylinux_2_X downwards, so list every compatible tag."""
    major, minor = (int(x) for x in glibc.split("."))
    tags = [f"manylinux_{major}_{m}_x86_64" for m in range(5, minor + 1)]
    return tags + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]


def has_python_extension(wheel: Path) -> bool:
    """True if a wheel holds a real CPython extension (exports PyInit_), not just a ctypes library."""
    with zipfile.ZipFile(wheel) as z:
        return any(n.endswith(".so") and b"PyInit_" in z.read(n) for n in z.namelist())


def retag_ctypes_wheel(wheel: Path, dest: Path) -> Path:
    """Turn a host-built wheel whose only binary is a ctypes-loaded C library into py3-none.

    python-iptables is published as an sdist only; its libxtwrapper links only against libc
    (GLIBC_2.7) and is found by ctypes under the plain name libxtwrapper.so too, so one build on
    the host serves every guest Python instead of a compiler in every guest.
    """
    m = re.match(r"^(.+?)-([^-]+)-[^-]+-[^-]+-([^-]+)\.whl$", wheel.name)
    if not m:
        die(f"cannot parse wheel name {wheel.name}")
    dist, version, plat = m.groups()
    out = dest / f"{dist}-{version}-py3-none-{plat}.whl"
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        renames: Dict[str, str] = {}
        for n in zin.namelist():
            if n.endswith(".so") and "/" not in n:
                renames[n] = re.sub(r"\.cpython-[^.]+\.so$", ".so", n)
        for info in zin.infolist():
            data = zin.read(info.filename)
            name = renames.get(info.filename, info.filename)
            if name.endswith(".dist-info/WHEEL"):
                text = re.sub(r"^Tag: .*$", f"Tag: py3-none-{plat}", data.decode(), flags=re.M)
                text = re.sub(r"^Root-Is-Purelib: .*$", "Root-Is-Purelib: false", text, flags=re.M)
                data = text.encode()
            if name.endswith(".dist-info/RECORD"):
                lines = []
                for line in data.decode().splitlines():
                    path = line.split(",")[0]
                    # A RECORD entry without hash is accepted by pip; ours changed, so drop it.
                    lines.append(f"{renames.get(path, path)},," if path in renames or path.endswith("WHEEL")
                                 else line)
                data = ("\n".join(lines) + "\n").encode()
            zout.writestr(name, data)
    return out


def target_args(python: str, pytag: str, glibc: str) -> List[str]:
    """pip options that select wheels for a guest's Python and glibc instead of the host's."""
    plats = [a for p in platforms(glibc) for a in ("--platform", p)]
    return ["--python-version", python, "--implementation", "cp", "--abi", pytag, "--abi", "abi3",
            "--abi", "none"] + plats


def build_wheelhouse(nodes: List[Node], timer: Timer) -> Path:
    """One flat directory of wheels for all guest Pythons (pure ones shared by all of them).

    Also writes <tag>.requirements (what the guest installs); install_deps() later completes the
    set with the guest's own resolver and freezes <tag>.lock.
    """
    wh = CACHE / "wheelhouse"
    wh.mkdir(parents=True, exist_ok=True)
    with timer.stage("wheelhouse"):
        wheel = project_wheel(wh)
        reqs = requirements(wheel)
        key = sha(json.dumps(sorted(reqs)), *sorted({n.pytag + n.glibc for n in nodes}))
        stamp = wh / "stamp"
        if stamp.exists() and stamp.read_text() == key and all((wh / f"{n.pytag}.constraints").exists()
                                                                for n in nodes):
            log(f"wheelhouse up to date ({wh})")
            return wh
        built = wh / "host-built"
        built.mkdir(exist_ok=True)
        for python, pytag, glibc in sorted({(n.python, n.pytag, n.glibc) for n in nodes}):
            log(f"wheelhouse: fetching for {pytag} (glibc {glibc})")
            _download_for(wh, built, reqs, target_args(python, pytag, glibc), pytag)
            (wh / f"{pytag}.requirements").write_text("\n".join(reqs) + "\n")
        stamp.write_text(key)
    return wh


def _download_for(wh: Path, built: Path, reqs: List[str], target: List[str], pytag: str) -> None:
    """Resolve and fetch binary wheels for one target Python; sdist-only packages are built on the host.

    The resolution (a dry-run install with a report) pins the versions the host's resolver picked
    for this Python; they become the guest's constraints, because the guest's pip does not
    backtrack past a distribution that is missing from the wheelhouse.
    """
    excluded: List[str] = []
    while True:
        pins = _resolve(wh, built, reqs + excluded, target, pytag)
        res = subprocess.run(host_pip() + ["download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(wh),
                                           "--find-links", str(wh)] + target + pins,
                             capture_output=True, text=True)
        if res.returncode == 0:
            break
        # An index without Requires-Python data lets the resolver pick a release the guest's Python
        # cannot run (iniconfig 2.3 needs 3.10; Debian 11 has 3.9); the wheel's own metadata says so.
        m = re.search(r"Package '([^']+)' requires a different Python", res.stderr)
        bad = _normal(m.group(1)) if m else None
        pin = next((p for p in pins if _normal(p.split("==")[0]) == bad), None)
        if pin is None or pin.replace("==", "!=") in excluded:
            die(f"pip cannot download the guest requirements for {pytag}:\n{res.stderr}")
        log(f"wheelhouse: {pin} does not run on {pytag}; resolving again without it")
        excluded.append(pin.replace("==", "!="))
    (wh / f"{pytag}.constraints").write_text("\n".join(pins) + "\n")


def _normal(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _resolve(wh: Path, built: Path, reqs: List[str], target: List[str], pytag: str) -> List[str]:
    """The versions the host's resolver picks for the target Python (a dry-run install's report)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = host_pip() + ["install", "-q", "--dry-run", "--ignore-installed", "--only-binary=:all:",
                            "--find-links", str(wh), "--target", tmp + "/t", "--report", str(report)]
        cmd += target + reqs
        while True:
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode == 0:
                break
            m = re.search(r"No matching distribution found for ([A-Za-z0-9_.\-]+)", res.stderr)
            if not m or (built / m.group(1)).exists():
                die(f"pip cannot resolve the guest requirements for {pytag}:\n{res.stderr}")
            # An sdist-only dependency: build it on the host and make it usable by every Python.
            name = m.group(1)
            log(f"wheelhouse: {name} has no binary wheel, building it on the host")
            (built / name).mkdir()
            run(host_pip() + ["wheel", "-q", "--no-deps", "-w", str(built / name), name], stdout=subprocess.DEVNULL)
            for w in (built / name).glob("*.whl"):
                if w.name.endswith("-none-any.whl"):
                    shutil.copy(w, wh)
                elif has_python_extension(w):
                    die(f"{w.name} is a CPython extension without a wheel for {pytag}; "
                        "it would need a compiler in the guest")
                else:
                    retag_ctypes_wheel(w, wh)
        pins = sorted(f"{it['metadata']['name']}=={it['metadata']['version']}"
                      for it in json.loads(report.read_text())["install"])
    return pins


# ---------------------------------------------------------------------------------------------
# Guest build


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


# ---------------------------------------------------------------------------------------------
# Boot


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
        watchdog = threading.Timer(TIMEOUT_S, lambda: (timed_out.set(), kill_pidfile(pidfile), proc.kill()))
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


# ---------------------------------------------------------------------------------------------
# Commands


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
