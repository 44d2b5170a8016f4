"""The command line's contract: exit codes, what is printed, --help everywhere.  Always the fake backend,
except for one guarded check that the real backends never claim success while they cannot run."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import pytest
import yaml

import netproxy.backends as backends
from netproxy import cli
from netproxy.backends.base import BackendUnavailable, SyncError
from netproxy.backends.fake import FakeBackend
from netproxy.cli import args as cli_args
from netproxy.cli import oneshot as cli_oneshot
from netproxy.core.config import ProxyConfig
from netproxy.core.model import Changes, Snapshot
from netproxy.migration import holdings
from netproxy.node import detect as detect_mod
from netproxy_lab.manifests import endpoint_slice, port, service

EXAMPLE = Path(__file__).parents[2] / "examples" / "cluster.yaml"
FAKE = ["--backend", "fake", "--iptables-flavour", "legacy", "--hostname-override", "node-a"]
_REAL_DETECT = detect_mod.detect  # captured at import, before any test patches the module
_REAL_FLAVOUR = detect_mod.iptables_flavour
_REAL_LAYOUT = detect_mod.ipv6_affinity_layout
NFT_1_0_6 = "nftables v1.0.6 (Lester Gooch #5)"


class Made:
    """Every backend the CLI created during a test, and how the next fake should behave."""

    def __init__(self) -> None:
        self.backends: List[Any] = []
        self.fail_with: Optional[str] = None

    @property
    def fake(self) -> FakeBackend:
        (only,) = self.backends
        assert isinstance(only, FakeBackend)
        return only

    def state(self) -> Dict[str, List[str]]:
        return {str(n): [str(e) for e in eps] for n, (_, eps) in sorted(self.fake.state.items())}


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> Made:
    record = Made()
    real_create = backends.create

    def create(name: str, config: ProxyConfig) -> Any:
        backend = real_create(name, config)
        if isinstance(backend, FakeBackend):
            backend.fail_next = record.fail_with
        record.backends.append(backend)
        return backend

    monkeypatch.setattr(backends, "create", create)
    return record


@pytest.fixture(autouse=True)
def no_real_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test here runs the node's iptables binary: the version check sees a fixed answer."""
    monkeypatch.setattr(detect_mod, "detect", _detect_with("iptables v1.8.9 (legacy)", False))
    monkeypatch.setattr(detect_mod, "iptables_flavour", lambda: _REAL_FLAVOUR(lambda: "iptables v1.8.9 (legacy)"))
    monkeypatch.setattr(detect_mod, "ipv6_affinity_layout", lambda: _REAL_LAYOUT(probe=lambda: NFT_1_0_6))
    # `detect` also surveys the node's rules (iptables-save, nf_tables): not the machine running the tests.
    monkeypatch.setattr(holdings, "survey", lambda: holdings.Holdings())


@pytest.fixture
def clean(tmp_path: Path) -> Path:
    path = tmp_path / "clean.yaml"
    path.write_text(yaml.safe_dump_all([service("web", "10.96.0.1"), endpoint_slice("web", ["10.0.0.1", "10.0.0.2"]),
                                        service("api", "10.96.0.2"), endpoint_slice("api", ["10.0.1.1"])]))
    return path


@pytest.fixture
def with_rejects(tmp_path: Path) -> Path:
    path = tmp_path / "rejects.yaml"
    path.write_text(yaml.safe_dump_all([service("web", "10.96.0.1"), endpoint_slice("web", ["10.0.0.1"]),
                                        service("bad", "10.96.0.3", [port(70000)]),
                                        service("api", "10.96.0.2"), endpoint_slice("api", ["10.0.1.1"])]))
    return path


# -- sync: exit codes --------------------------------------------------------------------------------

def test_sync_clean_file_exits_0_and_applies_everything(made: Made, clean: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["sync", "--source", str(clean), *FAKE]) == 0
    assert made.state() == {"default/api": ["10.0.1.1:8080"], "default/web": ["10.0.0.1:8080", "10.0.0.2:8080"]}
    assert made.fake.syncs == [Changes(full=True)]
    assert "rejected" not in capsys.readouterr().err


def test_sync_with_a_rejected_object_exits_2_names_it_and_applies_the_rest(
        made: Made, with_rejects: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["sync", "--source", str(with_rejects), *FAKE]) == 2
    err = capsys.readouterr().err
    assert "rejected Service default/bad: field spec.ports[0].port" in err
    assert "70000" in err
    assert made.state() == {"default/api": ["10.0.1.1:8080"], "default/web": ["10.0.0.1:8080"]}


def test_sync_keeps_its_last_objects_for_the_program_to_leave_with(made: Made, clean: Path) -> None:
    """The snapshot and the backend (its record) stay on ``args``, which the program holds until
    ``os._exit``: their frees were 0.08 s of a 10k-service sync for nothing.  Called from Python,
    they go with ``args`` (no leak into a long-lived caller)."""
    import gc
    import weakref

    args = cli.build_parser().parse_args(["sync", "--source", str(clean), *FAKE])
    assert cli_oneshot.cmd_sync(args) == 0
    backend = made.fake
    assert backend in args.kept_until_exit
    (snapshot,) = [k for k in args.kept_until_exit if isinstance(k, Snapshot)]
    assert len(snapshot.services) == 2
    gone = weakref.ref(backend)
    made.backends.clear()
    del backend, snapshot, args
    gc.collect()
    assert gone() is None


def test_sync_failing_write_exits_1(made: Made, clean: Path, capsys: pytest.CaptureFixture[str]) -> None:
    made.fail_with = "-A KUBE-SVC-ABC -j DROP"
    assert cli.main(["sync", "--source", str(clean), *FAKE]) == 1
    err = capsys.readouterr().err
    assert "sync error" in err and "-A KUBE-SVC-ABC -j DROP" in err
    assert made.fake.state == {}  # nothing half-applied


def test_sync_missing_source_exits_1(made: Made, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["sync", "--source", str(tmp_path / "nope.yaml"), *FAKE]) == 1
    assert "nope.yaml" in capsys.readouterr().err
    assert all(not getattr(b, "syncs", None) for b in made.backends)


@pytest.mark.parametrize("name, text", [("broken.yaml", "kind: Service\nmetadata: {name: [x\n"),
                                        ("broken.json", "{"), ("scalar.yaml", "just a string\n")])
def test_sync_unparsable_source_exits_1(made: Made, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    assert cli.main(["sync", "--source", str(path), *FAKE]) == 1
    assert "source" in capsys.readouterr().err
    assert all(not getattr(b, "syncs", None) for b in made.backends)


def test_sync_auto_backend_with_no_usable_dataplane_exits_1(
        monkeypatch: pytest.MonkeyPatch, clean: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(detect_mod, "detect", lambda: (_ for _ in ()).throw(detect_mod.DetectError("no backend")))
    assert cli.main(["sync", "--source", str(clean), "--backend", "auto"]) == 1
    assert "no backend" in capsys.readouterr().err


# -- plan, detect, cleanup ---------------------------------------------------------------------------

@pytest.mark.parametrize("command, code", [("plan", 0), ("trace", 2)])
def test_as_the_program_a_one_shot_command_leaves_with_its_code_and_every_byte(
        command: str, code: int, with_rejects: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Run as the program, a one-shot command ends without the interpreter's teardown (cli._leave):
    what it printed to a pipe (block-buffered: a plan's 8 KB and more, a trace's few lines) and to
    stderr must all arrive, with its exit code."""
    import os
    import subprocess
    import sys

    source = EXAMPLE if code == 0 else with_rejects
    argv = [command, "--source", str(source), "--backend", "nftables", "--hostname-override", "node-a",
            "--log-level", "warning", *(["--to", "10.96.0.1:80"] if command == "trace" else [])]
    assert cli.main(argv) == code  # in-process: returns
    want = capsys.readouterr()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as on a node
    proc = subprocess.run([sys.executable, "-m", "netproxy", *argv], capture_output=True, text=True, check=False,
                          env=env)
    assert proc.returncode == code
    assert proc.stdout == want.out and want.out.strip()
    assert proc.stderr == want.err and ("default/bad" in proc.stderr) == (code == 2)


def test_plan_prints_and_touches_nothing(made: Made, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--source", str(EXAMPLE), *FAKE]) == 0
    out = capsys.readouterr().out
    assert "10.96.0.53 udp 53 -> 10.244.1.21:5353 10.244.2.22:5353  # kube-system/dns:dns" in out
    assert "198.51.100.20 tcp 443 -> 10.244.1.51:8443 10.244.2.52:8443  # shop/checkout:https" in out
    assert "10.96.2.10 tcp 3000 -> reject  # monitoring/grafana:http" in out
    assert made.fake.syncs == [] and made.fake.state == {}


def test_plan_with_rejects_exits_2_and_still_prints(made: Made, with_rejects: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--source", str(with_rejects), *FAKE]) == 2
    captured = capsys.readouterr()
    assert "# default/web" in captured.out and "# default/api" in captured.out
    assert "default/bad" not in captured.out
    assert "default/bad" in captured.err


@pytest.mark.parametrize("line, libnft, expected", [
    ("iptables v1.8.9 (legacy)", False, ["backend: iptables", "iptables: legacy", "reason: legacy iptables 1.8.9"]),
    ("iptables v1.8.9 (nf_tables)", True, ["backend: nftables", "reason: iptables 1.8.9 is nf_tables-based"]),
    (None, True, ["backend: nftables", "evidence: iptables: not found", "evidence: libnftables: found"]),
], ids=["legacy", "nf_tables", "no-binary"])
def test_detect_prints_the_choice_and_evidence(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                               line: Optional[str], libnft: bool, expected: List[str]) -> None:
    monkeypatch.setattr(detect_mod, "detect", _detect_with(line, libnft))
    assert cli.main(["detect"]) == 0
    out = capsys.readouterr().out.splitlines()
    for want in expected:
        assert any(o.startswith(want) for o in out), (want, out)
    if line is None:
        assert not any(o.startswith("iptables:") for o in out)


def test_detect_without_any_dataplane_exits_1(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(detect_mod, "detect", _detect_with("iptables v1.3.8", False))
    assert cli.main(["detect"]) == 1
    out = capsys.readouterr().out
    assert "backend: none" in out and "1.3.8" in out


def _detect_with(line: Optional[str], libnft: bool) -> Callable[[], Any]:
    """The real version check, fed ``line`` as the output of `iptables --version`."""
    return lambda: _REAL_DETECT(version_probe=lambda: line, libnft_probe=lambda: libnft)


def test_cleanup_fake(made: Made) -> None:
    assert cli.main(["cleanup", *FAKE[:4]]) == 0
    assert made.fake.cleaned


# -- flags -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [[], ["sync"], ["run"], ["plan"], ["status"], ["detect"], ["cleanup"]],
                         ids=["top", "sync", "run", "plan", "status", "detect", "cleanup"])
def test_help_on_every_command(argv: List[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([*argv, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: netproxy")
    assert "--log-level" in out or not argv
    if argv and argv[0] in ("sync", "run", "plan"):
        for flag in ("--source", "--backend", "--sync-period", "--min-sync-period", "--masquerade-all"):
            assert flag in out


def test_sync_requires_a_source(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod: no service account either
    assert cli.main(["sync", "--backend", "fake"]) == 1
    assert "pass --source PATH or --kubeconfig PATH" in capsys.readouterr().err


@pytest.mark.parametrize("text, seconds", [("30s", 30.0), ("1m", 60.0), ("500ms", 0.5), ("2", 2.0),
                                           ("1.5h", 5400.0), (" 10s ", 10.0)])
def test_durations(text: str, seconds: float) -> None:
    assert cli_args.duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "s", "-1s", "10d", "1m30s", "ten"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        cli_args.duration(text)


def test_flags_reach_the_config(made: Made, clean: Path) -> None:
    assert cli.main(["sync", "--source", str(clean), *FAKE, "--sync-period", "1m", "--min-sync-period", "250ms",
                     "--masquerade-all", "--cluster-cidr", "10.244.0.0/16,fd00:244::/56"]) == 0
    config = made.fake.config
    assert (config.sync_period, config.min_sync_period, config.masquerade_all) == (60.0, 0.25, True)
    assert [str(c) for c in config.cluster_cidrs] == ["10.244.0.0/16", "fd00:244::/56"]
    assert config.hostname == "node-a"


def test_a_bad_cidr_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str], clean: Path) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["sync", "--source", str(clean), *FAKE, "--cluster-cidr", "10.0.0.0/8,nope"])
    assert info.value.code != 0
    assert "'nope'" in capsys.readouterr().err


# -- the real backends: never a false success --------------------------------------------------------

class Guard:
    """Real backends whose sync and cleanup cannot write: reaching one is recorded and fails instead."""

    def __init__(self) -> None:
        self.reached: List[str] = []
        self.unavailable = False  # make probe raise, as on a node without the binaries or library


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch) -> Iterator[Guard]:
    guard = Guard()
    reached = guard.reached
    real_create = backends.create

    def create(name: str, config: ProxyConfig) -> Any:
        backend = real_create(name, config)
        if guard.unavailable:
            def probe() -> None:
                raise BackendUnavailable(f"{name}: not on this node (simulated)")

            backend.probe = probe

        def refuse(snapshot: Snapshot, changes: Changes) -> Any:
            reached.append(name)
            raise SyncError("unit tests never write to the kernel")

        backend.sync = refuse
        backend.cleanup = lambda: reached.append(f"{name} cleanup")
        return backend

    monkeypatch.setattr(backends, "create", create)
    yield guard


@pytest.mark.parametrize("name", ["iptables", "nftables"])
def test_real_backend_with_a_failing_probe_exits_1_before_writing(
        name: str, guarded: Guard, clean: Path, capsys: pytest.CaptureFixture[str]) -> None:
    guarded.unavailable = True
    assert cli.main(["sync", "--source", str(clean), "--backend", name, "--iptables-flavour", "legacy"]) == 1
    assert guarded.reached == []
    assert "not on this node (simulated)" in capsys.readouterr().err


def test_usage_errors_exit_1_not_2() -> None:
    # 2 promises "the valid rest was applied": a usage error applied nothing.
    with pytest.raises(SystemExit) as info:
        cli.main(["sync", "--source", "x", "--backend", "nope"])
    assert info.value.code == 1


@pytest.mark.parametrize("command", ["sync", "run", "plan", "cleanup"])
def test_the_fake_backend_is_accepted_but_not_advertised(command: str, made: Made, clean: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    assert "{auto,iptables,nftables" in out and "fake" not in out
    assert cli.main(["sync", "--source", str(clean), "--backend", "fake", "--hostname-override", "node-a"]) == 0
    assert [b.name for b in made.backends] == ["fake"] and made.state()  # it ran, and wrote the services


def test_json_logs_are_one_object_per_line() -> None:
    import json as _json
    import logging

    from netproxy.observe import logs

    record = logging.LogRecord("netproxy.test", logging.WARNING, __file__, 1, "rejected %s", ("Service a/b",), None)
    got = _json.loads(logs.JsonFormatter().format(record))
    assert got["level"] == "warning" and got["logger"] == "netproxy.test" and got["msg"] == "rejected Service a/b"
    assert "\n" not in logs.JsonFormatter().format(record)
    assert cli.build_parser().parse_args(["detect", "--log-format", "json"]).log_format == "json"


def test_detect_says_what_the_node_holds_and_what_migrate_would_do(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    kube_proxy = holdings.Ruleset("kube-proxy", "iptables", "legacy", (4,), frozenset({"0x4000"}))
    monkeypatch.setattr(holdings, "survey", lambda: holdings.Holdings([kube_proxy]))
    monkeypatch.setattr(detect_mod, "detect", _detect_with("iptables v1.8.9 (nf_tables)", True))
    assert cli.main(["detect"]) == 0
    out = capsys.readouterr().out
    assert "holds: kube-proxy's iptables-legacy rules (IPv4), masquerade mark 0x4000" in out
    assert "`netproxy migrate --to nftables --from-kube-proxy` would program nftables" in out
    assert "then remove kube-proxy's iptables-legacy rules" in out


@pytest.mark.parametrize("nft, layout", [(NFT_1_0_6, "sets"), ("nftables v1.1.3 (Commodore Bullmoose #4)", "maps")],
                         ids=["nft-1.0.6", "nft-1.1.3"])
def test_the_node_nft_decides_the_ipv6_affinity_layout_detect_shows_and_plan_renders(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, nft: str,
        layout: str) -> None:
    monkeypatch.setattr(detect_mod, "detect", _detect_with("iptables v1.8.9 (nf_tables)", True))
    monkeypatch.setattr(detect_mod, "ipv6_affinity_layout", lambda: _REAL_LAYOUT(probe=lambda: nft))
    assert cli.main(["detect"]) == 0
    assert f"ipv6 affinity: {layout} (nft {nft.split()[1][1:]} " in capsys.readouterr().out
    source = tmp_path / "sticky6.yaml"
    source.write_text(yaml.safe_dump_all([
        service("web", "fd00::10", sessionAffinity="ClientIP", ipFamilies=["IPv6"]),
        endpoint_slice("web", ["fd01::1", "fd01::2"], address_type="IPv6")]))
    assert cli.main(["plan", "--source", str(source), "--backend", "nftables", "--hostname-override", "node-a"]) == 0
    plan = capsys.readouterr().out
    assert ("add map ip6 netproxy affinity-tcp {" in plan) == (layout == "maps"), plan
    assert ("add set ip6 netproxy aff-default/web-fd01__1-8080 {" in plan) == (layout == "sets"), plan


def test_migrate_failure_exits_1_naming_the_step(made: Made, clean: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from netproxy.migration import migrate

    def fail(*_a: Any, **_k: Any) -> Any:
        raise migrate.MigrateError("verify", "the kernel does not hold the new nftables rules")

    monkeypatch.setattr(migrate, "migrate", fail)
    monkeypatch.setattr(cli_oneshot, "make_backend",
                        lambda args, node=None: (FakeBackend(), ProxyConfig(hostname="node-a")))
    assert cli.main(["migrate", "--to", "nftables", "--source", str(clean), "--hostname-override", "node-a"]) == 1
    assert "netproxy migrate: verify: the kernel does not hold" in capsys.readouterr().err


def test_migrate_requires_to(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["migrate", "--source", "x.yaml"])
    assert exited.value.code == 1 and "--to" in capsys.readouterr().err


def test_a_min_sync_period_over_the_sync_period_is_a_clear_error(made: Made, clean: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """kube-proxy's validation (syncPeriod >= minSyncPeriod), named by flag, exit 1 — not a traceback."""
    assert cli.main(["sync", "--source", str(clean), *FAKE, "--sync-period", "2s", "--min-sync-period", "20s"]) == 1
    assert "--min-sync-period (20s) must not exceed --sync-period (2s)" in capsys.readouterr().err
