"""The lab's pieces that need no root: stopping processes, the combinations, the manifests."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from netproxy_lab import combos
from netproxy_lab.cleanup import stop_netproxy, stop_process
from netproxy_lab.manifests import endpoint_slice, port, service, write_manifests
from netproxy_lab.topology import Pod

IGNORES_TERM = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); " \
               "time.sleep(60)"


def _started(argv: list, **kwargs: object) -> subprocess.Popen:  # type: ignore[type-arg]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, **kwargs)  # type: ignore[call-overload]
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    return proc  # type: ignore[no-any-return]


def test_stop_process_ends_a_child_by_sigterm() -> None:
    proc = _started([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"])
    assert stop_process(proc) == -signal.SIGTERM


def test_stop_process_kills_a_child_that_ignores_sigterm_after_the_timeout() -> None:
    proc = _started([sys.executable, "-c", IGNORES_TERM])
    t0 = time.monotonic()
    assert stop_process(proc, timeout=0.5) == -signal.SIGKILL
    assert 0.4 < time.monotonic() - t0 < 5


def test_stop_netproxy_has_a_stuck_run_print_its_stacks_before_the_kill(tmp_path: pathlib.Path) -> None:
    # A child stuck as netproxy run once was: SIGTERM does nothing; SIGUSR1 prints its stacks (as
    # netproxy/cli/signals.py installs it), which must reach its log before SIGKILL.
    code = ("import faulthandler, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "faulthandler.register(signal.SIGUSR1, all_threads=True); print('ready', flush=True); time.sleep(60)")
    log = tmp_path / "run.log"
    with open(log, "wb") as err:
        proc = _started([sys.executable, "-c", code], stderr=err)
    assert stop_netproxy(proc, timeout=0.5) == -signal.SIGKILL
    assert "Current thread" in log.read_text() and "<string>" in log.read_text(), log.read_text()


def test_stop_process_takes_a_session_leaders_group_with_it() -> None:
    # The leader forks a grandchild that ignores SIGTERM as well; signalling the leader alone would leave it.
    code = ("import os, subprocess, sys; "
            f"g = subprocess.Popen([sys.executable, '-c', {IGNORES_TERM!r}], stdout=subprocess.PIPE); "
            "g.stdout.readline(); print(g.pid, flush=True); print('ready', flush=True); g.wait()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    assert proc.stdout is not None
    grandchild = int(proc.stdout.readline())
    assert proc.stdout.readline().strip() == b"ready"
    stop_process(proc, timeout=0.5)
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{grandchild}") and time.monotonic() < deadline:
        with open(f"/proc/{grandchild}/stat") as f:
            if f.read().split(") ")[1].startswith("Z"):  # reaped by init soon; a zombie is gone already
                break
        time.sleep(0.05)
    else:
        assert not os.path.exists(f"/proc/{grandchild}"), "the grandchild outlived its group's stop"


def test_stop_process_leaves_an_exited_child_alone() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    assert stop_process(proc) == 3


def test_parse_reads_names_and_aliases_and_names_an_unknown_one() -> None:
    assert [c.name for c in combos.parse("nft, libiptc")] == ["nftables", "iptables-legacy/libiptc"]
    assert combos.parse("") == combos.parse("all") == list(combos.COMBOS.values())
    with pytest.raises(ValueError, match="'bogus'"):
        combos.parse("nftables,bogus")


def test_selected_follows_netproxy_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NETPROXY_BACKENDS", "iptables-nft/restore")
    assert [c.name for c in combos.selected()] == ["iptables-nft/restore"]
    monkeypatch.setenv("NETPROXY_TIER", "full")  # a named set wins over the tier, and over a module's list
    assert [c.name for c in combos.selected(("nftables",))] == ["iptables-nft/restore"]


def test_the_quick_tier_runs_the_default_writers_unless_a_module_says_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NETPROXY_BACKENDS", raising=False)
    monkeypatch.delenv("NETPROXY_TIER", raising=False)
    assert [c.name for c in combos.selected()] == ["nftables", "iptables-legacy/restore", "iptables-nft/restore"]
    assert [c.name for c in combos.selected(("all",))] == list(combos.COMBOS)
    assert [c.name for c in combos.selected(("nftables",))] == ["nftables"]
    monkeypatch.setenv("NETPROXY_TIER", "full")
    assert [c.name for c in combos.selected(("nftables",))] == list(combos.COMBOS)
    monkeypatch.setenv("NETPROXY_TIER", "fast")
    with pytest.raises(ValueError, match="NETPROXY_TIER='fast'"):
        combos.selected()


def test_a_fault_knob_follows_the_tier_and_its_variable_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    from netproxy_lab.tier import knob

    monkeypatch.delenv("NETPROXY_STORM_SECONDS", raising=False)
    monkeypatch.setenv("NETPROXY_TIER", "quick")
    assert knob("NETPROXY_STORM_SECONDS", quick=4, full=30) == 4
    monkeypatch.setenv("NETPROXY_TIER", "full")
    assert knob("NETPROXY_STORM_SECONDS", quick=4, full=30) == 30
    monkeypatch.setenv("NETPROXY_STORM_SECONDS", "90")
    assert knob("NETPROXY_STORM_SECONDS", quick=4, full=30) == 90
    monkeypatch.setenv("NETPROXY_STORM_SECONDS", "lots")
    with pytest.raises(ValueError, match="NETPROXY_STORM_SECONDS='lots'"):
        knob("NETPROXY_STORM_SECONDS", quick=4, full=30)


def test_a_combos_flags_name_its_backends_own_writer() -> None:
    assert combos.COMBOS["nftables/libnftables"].flags == [
        "--backend", "nftables", "--nftables-writer", "libnftables", "--iptables-flavour", "nft"]
    legacy = combos.COMBOS["iptables-legacy/libiptc"]
    assert legacy.flags == ["--backend", "iptables", "--iptables-writer", "libiptc", "--iptables-flavour", "legacy"]
    assert legacy.family == "iptables" and legacy.slug == "iptables-legacy-libiptc"
    assert combos.COMBOS["iptables-nft/restore"].family == "nft"


def test_manifests_load_as_a_service_and_its_slice(tmp_path: object) -> None:
    from netproxy.source.files import load

    pod = Pod("pod-0", "np-pod0-x", "10.244.1.10", "fd00:10:244:1::a", "np-node")
    path = os.path.join(str(tmp_path), "cluster.yaml")
    write_manifests(path, [service("web", "10.96.0.10", [port(80, 8080, name="http")]),
                           endpoint_slice("web", [pod], [{"name": "http", "port": 8080, "protocol": "TCP"}])])
    assert not os.path.exists(path + ".tmp")
    with open(path) as f:
        docs = [json.loads(d) for d in f.read().split("---\n") if d.strip()]
    assert [d["kind"] for d in docs] == ["Service", "EndpointSlice"]
    loaded = load(path)
    assert loaded.errors == []
    (ports,) = loaded.services.values()
    assert [(p.port, [str(ip) for ip in p.cluster_ips]) for p in ports] == [(80, ["10.96.0.10"])]
    (endpoints,) = loaded.endpoints.values()
    assert "10.244.1.10" in repr(endpoints)


def test_the_demo_finds_the_bundled_example() -> None:
    """``make demo`` runs without arguments: its default source must be the repository's example
    (it pointed into netproxy/ once the demo moved into the lab)."""
    from netproxy_lab import demo

    assert os.path.isfile(demo.EXAMPLE), demo.EXAMPLE
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "cluster.yaml")
    assert os.path.samefile(demo.EXAMPLE, example)
