"""What a backend's rules look like in the kernel, as the kernel's own tool lists them (``netproxy
plan --diff``).

The rendered ruleset is loaded into a throwaway network namespace (``unshare --net``: anonymous, gone
when the command exits) and listed there with the same tool and the same normalisation as the node's
real tables, so that both sides of the diff are spelled by the kernel: no second parser of either
syntax can make them disagree.  Nothing is written to the node's own namespace.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import List, Optional, Tuple

try:
    from typing import Protocol
except ImportError:  # pragma: no cover
    from typing_extensions import Protocol  # type: ignore[assignment]

from netproxy.backends.base import BackendUnavailable, Outcome, Packet

TIMEOUT = 60.0


class Listing(Protocol):
    def kernel(self) -> List[str]:
        """Every line of this backend's objects in the node's tables now, normalised, in order."""

    def rendered(self, plan: str) -> List[str]:
        """``plan`` (the backend's :meth:`Backend.plan` text) loaded into a scratch namespace and
        listed exactly as :meth:`kernel` lists the node's tables."""

    def trace(self, packet: Packet) -> List[Outcome]:
        """Where ``packet`` goes through the rules the node's tables hold now (``netproxy trace
        --kernel``); BackendUnavailable where this backend cannot trace its kernel state yet."""

    def programmed(self) -> List[Tuple[str, str, Tuple[str, ...]]]:
        """(service, "address:port/proto", endpoints, or ("reject",)) for every service port the
        node's tables dispatch now (``netproxy status --kernel``)."""


def run(cmd: List[str], stdin: Optional[str] = None, scratch: bool = False) -> str:
    """A listing tool's output; BackendUnavailable saying why when it cannot run.

    ``scratch`` runs ``cmd`` (a shell script) in a new, empty network namespace of its own.
    """
    if scratch:
        unshare = shutil.which("unshare")
        if unshare is None:
            raise BackendUnavailable("unshare (util-linux) is needed to render the plan in a scratch namespace")
        cmd = [unshare, "--net", "--", "sh", "-ec", *cmd]
    try:
        proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise BackendUnavailable(f"{cmd[0]}: {err}") from None
    if proc.returncode != 0:
        raise BackendUnavailable(f"{' '.join(cmd[:3])} failed: {proc.stderr.strip()[:500]}")
    return proc.stdout
