"""Scratch namespaces and child processes for the benchmark, always removed — even on failure or a signal.

Every namespace the benchmark creates is named ``np-bench-<pid>-<n>-<role>`` and recorded here; it is
deleted by that name in a ``finally``, at exit, and on SIGINT/SIGTERM/SIGHUP.  Processes started into
a namespace are recorded by PID and their own process group (``start_new_session``) and killed by
that PID only, before their namespace goes.  The host namespace is never changed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
from typing import Dict, Iterator, List, Optional, Sequence

from netproxy_lab.cleanup import delete_namespace, stop_process

PREFIX = "np-bench-"
_lock = threading.Lock()
_namespaces: List[str] = []
_children: Dict[int, subprocess.Popen] = {}  # type: ignore[type-arg]
_counter = [0]
_installed = [False]
_owner = [0]  # the PID that installed the handlers: a fork()ed child (pyroute2 forks) must not act on them


class NetnsError(RuntimeError):
    """A namespace could not be created or a command in it failed."""


def _run(args: Sequence[str], check: bool = True, input_: Optional[bytes] = None) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    proc = subprocess.run(list(args), input=input_, capture_output=True, check=False)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(args)}: exit {proc.returncode}: {proc.stderr.decode(errors='replace').strip()}")
    return proc


def install_handlers() -> None:
    """Clean up at exit and turn SIGTERM/SIGHUP into SystemExit so that ``finally`` blocks run."""
    if _installed[0]:
        return
    _installed[0] = True
    _owner[0] = os.getpid()
    atexit.register(cleanup_all)

    def _on_signal(signum: int, _frame: object) -> None:
        if os.getpid() != _owner[0]:
            # A fork()ed child inherits this handler: pyroute2's netns helpers fork and SIGTERM their
            # child when done.  Raising SystemExit there would unwind OUR stack in the child and run our
            # finally blocks (deleting the sandbox under our feet); just die as SIGTERM would.
            os._exit(128 + signum)
        cleanup_all()
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)


def create(role: str) -> str:
    """A new namespace with loopback up; its name."""
    install_handlers()
    with _lock:
        _counter[0] += 1
        name = f"{PREFIX}{os.getpid()}-{_counter[0]}-{role}"[:60]
        _namespaces.append(name)
    _run(["ip", "netns", "add", name])
    _run(["ip", "-n", name, "link", "set", "lo", "up"])
    return name


def delete(name: str) -> None:
    """Kill the children started in ``name`` and delete it (by name; never anything else)."""
    for proc in list(_children.values()):
        if getattr(proc, "bench_netns", None) == name:
            stop(proc)
    delete_namespace(name)
    with _lock:
        if name in _namespaces:
            _namespaces.remove(name)


@contextlib.contextmanager
def namespace(role: str) -> Iterator[str]:
    name = create(role)
    try:
        yield name
    finally:
        delete(name)


def exec_args(ns: str, args: Sequence[str]) -> List[str]:
    return ["ip", "netns", "exec", ns, *args]


def run_in_timeout(ns: str, args: Sequence[str], timeout: float,
                   env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:  # type: ignore[type-arg]
    """Run ``args`` in ``ns`` to completion; on timeout kill its whole process group (ours) and raise."""
    proc = spawn(ns, args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        raise
    _children.pop(proc.pid, None)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def spawn(ns: str, args: Sequence[str], **kwargs: object) -> subprocess.Popen:  # type: ignore[type-arg]
    """Start ``args`` inside ``ns`` in its own process group, remembered for cleanup."""
    install_handlers()
    proc = subprocess.Popen(exec_args(ns, args), start_new_session=True, **kwargs)  # type: ignore[call-overload]
    proc.bench_netns = ns
    _children[proc.pid] = proc
    return proc  # type: ignore[no-any-return]


def stop(proc: subprocess.Popen, timeout: float = 3.0) -> None:  # type: ignore[type-arg]
    """Forget ``proc`` and stop it (its whole process group: :func:`spawn` gave it one)."""
    _children.pop(proc.pid, None)
    stop_process(proc, timeout)


def cleanup_all() -> None:
    if _owner[0] and os.getpid() != _owner[0]:
        return  # a fork()ed child: the namespaces are the parent's to remove
    for proc in list(_children.values()):
        stop(proc, timeout=1.0)
    for name in list(_namespaces):
        delete(name)


def stale() -> List[str]:
    """Namespaces left by an earlier benchmark whose process is gone (named np-bench-<dead pid>-…)."""
    proc = _run(["ip", "netns", "list"], check=False)
    out = []
    for line in proc.stdout.decode().splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            out.append(name)
    return out


def remove_stale() -> None:
    for name in stale():
        print(f"bench: removing namespace {name} left by an earlier run", file=sys.stderr)
        delete_namespace(name)
