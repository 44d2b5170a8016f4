"""The lab as a pytest plugin: the kernel tests' and the fault suite's fixtures.

Registered for the whole repository by the root ``conftest.py`` (``pytest_plugins``); any test can use:

- ``kernel_env`` — root and a working ``ip netns``, or skip;
- ``combo``   — one backend/writer combination (module scope, parametrised over
  ``NETPROXY_BACKENDS`` when set, else the tier's choice: :mod:`netproxy_lab.tier`; a module's
  ``@pytest.mark.quick_combos("name", ...)`` (or ``"all"``) says what it runs in the quick tier);
- ``sandbox`` — a client / node / ext / pods topology for that module and combination;
- ``proxy``   — a :class:`~netproxy_lab.proxy.Proxy` that runs netproxy in the node with the
  combination's flags and resets the node's netfilter state (every table of every flavour,
  conntrack) after each test, so tests share a sandbox without seeing each other's rules;
- ``bare_sandbox`` — a sandbox for tests that choose their own flags.

Not root → skip.  ``CI=true`` → a missing capability (root, ``ip netns``, a binary, a library)
fails instead, so that a CI machine cannot pass by skipping.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
from typing import Any, Generator, Iterator, Optional

import pytest

from netproxy_lab.combos import Combo, selected
from netproxy_lab.proxy import Proxy
from netproxy_lab.topology import Sandbox, kernel_has_sctp


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def require(condition: bool, reason: str) -> None:
    """Skip when ``condition`` is false — or fail, under ``CI=true``."""
    if condition:
        return
    if in_ci():
        pytest.fail(f"CI=true and {reason}", pytrace=False)
    pytest.skip(reason)


def require_sctp(what: str = "SCTP") -> None:
    """SCTP in this kernel, or the one reason a test may go without it.  The VM guests, whose kernels
    have it, set NETPROXY_REQUIRE_SCTP=1 (vagrant/guest-test): a missing SCTP fails there.  On a host
    without it the test skips only when this run's guests test SCTP through the proxy
    (NETPROXY_SCTP_IN_GUESTS=1, set by scripts/run-tests when it boots them); otherwise CI=true
    fails it, as any missing capability."""
    why = kernel_has_sctp()
    if why is None:
        return
    if os.environ.get("NETPROXY_REQUIRE_SCTP") == "1":
        pytest.fail(f"NETPROXY_REQUIRE_SCTP=1 and {why}", pytrace=False)
    if os.environ.get("NETPROXY_SCTP_IN_GUESTS") == "1":
        pytest.skip(f"{what}: {why}; this run's QEMU guests test SCTP (NETPROXY_SCTP_IN_GUESTS=1)")
    require(False, f"{why}, and no guest of this run tests SCTP (NETPROXY_SCTP_IN_GUESTS unset)")


def _netns_works() -> Optional[str]:
    probe = f"np-probe-{os.getpid()}"
    try:
        add = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if add.returncode != 0:
            return f"`ip netns add` failed: {add.stderr.strip()}"
        return None
    except OSError as err:
        return f"`ip` not runnable: {err}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


@pytest.fixture(scope="session")
def kernel_env() -> None:
    """Root and working ``ip netns`` — or skip (fail under CI=true)."""
    require(os.geteuid() == 0, "kernel tests need root")
    why = _netns_works()
    require(why is None, why or "")
    require(importlib.util.find_spec("pyroute2") is not None, "pyroute2 is not importable")


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM (a CI deadline, ``timeout``) ends the run as Ctrl-C does: the fixtures' teardown
    deletes the sandboxes' namespaces and stops their processes instead of leaving them behind."""

    owner = os.getpid()

    def interrupt(signum: int, _frame: Any) -> None:
        if os.getpid() != owner:
            # A fork()ed child inherits this handler (pyroute2's netns helpers fork, then SIGTERM the
            # child when done): raising there would unwind the test run's stack in the child.  Die as
            # SIGTERM would.
            os._exit(128 + signum)
        raise KeyboardInterrupt(f"signal {signum}")

    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, interrupt)


CALL_REPORT = pytest.StashKey[pytest.TestReport]()
"""The report of a test's call phase, kept on its item for fixtures' teardown (did the test pass?)."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport,
                                                                                           pytest.TestReport]:
    report = yield
    if report.when == "call":
        item.stash[CALL_REPORT] = report
    return report


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "combo" in metafunc.fixturenames:
        try:
            marker = metafunc.definition.get_closest_marker("quick_combos")
            combos = selected(marker.args if marker else ())
        except ValueError as err:
            raise pytest.UsageError(f"NETPROXY_BACKENDS / NETPROXY_TIER: {err}") from None
        only = metafunc.definition.get_closest_marker("backends")
        if only is not None:
            # What the module is about exists on these backends alone: the others are not
            # collected in any tier (rather than collected and skipped, a skip a reader must check).
            combos = [c for c in combos if c.backend in only.args]
        metafunc.parametrize("combo", combos, ids=[c.name for c in combos], scope="module", indirect=True)


@pytest.fixture(scope="module")
def combo(request: pytest.FixtureRequest, kernel_env: None) -> Combo:
    return require_combo(request.param)


def require_combo(chosen: Combo) -> Combo:
    """``chosen``, if it can run here; else skip (fail under CI=true) naming what it lacks."""
    why = chosen.missing()
    require(why is None, f"{chosen.name}: {why}")
    return chosen


@pytest.fixture(scope="module")
def sandbox(kernel_env: None, combo: Combo) -> Iterator[Sandbox]:
    """Four pods (pod-3 is never an endpoint unless a test says so), per module and combination;
    they answer SCTP on 8080 too where the kernel has SCTP."""
    sctp = (8080,) if kernel_has_sctp() is None else ()
    with Sandbox(pods=4, tcp_ports=(8080, 9090), udp_ports=(8080,), sctp_ports=sctp) as sb:
        yield sb


def driven(sandbox: Sandbox, combo: Combo, workdir: str) -> Iterator[Proxy]:
    """A :class:`Proxy` for one test on an emptied node; its runs stopped and the node reset after."""
    driver = Proxy(sandbox, combo, workdir)
    sandbox.reset_netfilter()
    try:
        yield driver
    finally:
        driver.reset()


@pytest.fixture()
def proxy(sandbox: Sandbox, combo: Combo, tmp_path: Any) -> Iterator[Proxy]:
    yield from driven(sandbox, combo, str(tmp_path))


@pytest.fixture(scope="module")
def bare_sandbox(kernel_env: None) -> Iterator[Sandbox]:
    """A sandbox for tests that choose their own flags (start-up selection, harness self-tests)."""
    with Sandbox(pods=3) as sb:
        yield sb
    # No netfilter reset needed: the namespaces, and all their tables, are gone.
