"""The wheelhouse: the project's dependencies for each guest's Python, fetched on the host.

One flat directory of wheels under the cache for every guest Python (pure ones shared), with
``<tag>.requirements`` and ``<tag>.constraints`` for the guest's own pip (``vm_guest.install_deps``);
sdist-only dependencies are built on the host and, when their only binary is a ctypes library,
retagged so that one build serves every guest.
"""

from __future__ import annotations

import email.parser
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Dict, List

from vm_common import CACHE, REPO, Node, Timer, die, log, run, sha


def host_pip() -> List[str]:
    return [sys.executable, "-m", "pip"]


def project_wheel(dest: Path) -> Path:
    """Build the checkout's own wheels (pure Python) into dest, replacing older ones: netproxy's, and
    the lab's (lab/: the tests' fixtures, its own distribution); netproxy's is returned."""
    for old in [*dest.glob("netproxy-*.whl"), *dest.glob("netproxy_lab-*.whl")]:
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        # Build from a copy: building in the checkout would leave build/ and egg-info behind in
        # other people's working tree.
        src = Path(tmp) / "src"
        shutil.copytree(
            REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache")
        )
        res = subprocess.run(host_pip() + ["wheel", "-q", "--no-deps", "-w", str(dest), str(src), str(src / "lab")],
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

    Also writes <tag>.requirements (what the guest installs); vm_guest.install_deps() later completes the
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
