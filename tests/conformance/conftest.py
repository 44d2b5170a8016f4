"""The conformance traces never reach the kernel: the same fakes as the unit tests (the iptables
backend's ipsets in memory, no watch on the host's tables)."""

from tests.unit.conftest import _fake_ipsets  # noqa: F401  (an autouse fixture, used by being here)
