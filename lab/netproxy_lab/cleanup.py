"""Stopping what the lab started and deleting the namespaces it made: by PID and by name, never by pattern.

Every part of the lab (the :class:`~netproxy_lab.topology.Sandbox`, the benchmark's scratch
namespaces in :mod:`netproxy_lab.netns`, the tests' ``netproxy run`` processes) ends its children
and its namespaces through these two functions, so that there is one way to do it and it cannot
reach anything the lab did not start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from typing import Optional

log = logging.getLogger(__name__)


def stop_process(proc: subprocess.Popen, timeout: float = 3.0,  # type: ignore[type-arg]
                 dump: Optional[int] = None) -> Optional[int]:
    """SIGTERM ``proc``, wait up to ``timeout`` seconds, then SIGKILL it; its exit status.

    A child started with ``start_new_session`` leads a process group of its own (whose id is its
    PID): the whole group gets the signals, and what is left of the group once the child has
    exited is killed, so that nothing it forked outlives it.  Any other child gets the signals
    alone.  Its pipes are closed afterwards.  ``dump``: a signal sent to the child alone before the
    SIGKILL, for its stacks (netproxy prints them on SIGUSR1: :func:`stop_netproxy`).
    """
    if proc.poll() is None:
        group = _leads_group(proc)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            _signal(proc, sig, group)
            try:
                proc.wait(timeout)
                break
            except subprocess.TimeoutExpired:
                if dump is not None and sig == signal.SIGTERM:
                    # Where it is stuck, into its own log, before the kill erases it.
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(dump)
                    time.sleep(1.0)
        if group:
            # The group's id stays reserved while any member lives, so this reaches only our child's.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    return proc.returncode


def stop_netproxy(proc: subprocess.Popen, timeout: float = 10.0) -> Optional[int]:  # type: ignore[type-arg]
    """:func:`stop_process` for a ``netproxy run``: if SIGTERM does not stop it in ``timeout``
    seconds, its threads' stacks reach its log (SIGUSR1) before it is killed."""
    return stop_process(proc, timeout, dump=signal.SIGUSR1)


def _leads_group(proc: subprocess.Popen) -> bool:  # type: ignore[type-arg]
    try:
        return os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        return False


def _signal(proc: subprocess.Popen, sig: int, group: bool) -> None:  # type: ignore[type-arg]
    # The group whose id is our child's PID can only be our child's own: a PID is not reused while
    # the child it names is still ours (not yet waited for).
    try:
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except ProcessLookupError:
        pass  # already gone (a zombie is still waitable; wait() collects it)


def delete_namespace(name: str) -> bool:
    """``ip netns delete NAME``: takes its veths, addresses, routes, sysctls and netfilter state with it.

    Whether it is gone; a failure is logged, not raised, so that cleanup goes on with the rest.
    """
    proc = subprocess.run(["ip", "netns", "delete", name], capture_output=True, text=True, check=False)
    if proc.returncode != 0 and os.path.exists(os.path.join("/run/netns", name)):
        log.warning("could not remove netns %s: %s", name, proc.stderr.strip())
        return False
    return True
