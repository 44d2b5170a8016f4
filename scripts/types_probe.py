"""`make lint`'s probe that mypy sees netproxy.backends: type-checked by scripts/lint-types, never run.

A module mypy cannot find is ``Any`` under the project's ignore_missing_imports, and ``Any`` passes every
check silently: that is how netproxy.backends went unchecked while backends/ was mapped into the package
only by the install.  Each assert_type below holds only if mypy sees the symbol's real type, so the
expected types come from outside the backends (a backend type would turn into ``Any`` with them).  One
symbol per package of netproxy.backends that the wheel installs (pyproject.toml's packages).
"""

from __future__ import annotations

from typing import Optional, Tuple

from typing_extensions import assert_type

from netproxy.backends import remove_rules_only
from netproxy.backends.base import SyncResult
from netproxy.backends.iptables import names as iptables_names
from netproxy.backends.iptables.kernel import restore
from netproxy.backends.nftables import layout
from netproxy.backends.nftables.kernel import libnftables


def probe(result: SyncResult) -> None:
    assert_type(remove_rules_only("legacy"), None)
    assert_type(result.bytes_written, int)
    assert_type(iptables_names.is_owned("KUBE-SERVICES"), bool)
    assert_type(restore.supports_random_fully("legacy"), bool)
    assert_type(layout.FAMILIES, Tuple[str, str])
    assert_type(libnftables.failing_command("Error: ..."), Optional[str])
